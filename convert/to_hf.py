"""`k3jax export`: a k3jax Orbax checkpoint -> the official safetensors layout, streaming.

Names, dtypes (the F32 exceptions too), shapes and shards follow the source the checkpoint was
converted from: its manifest keeps each shard's header, and a header written back unchanged
puts every tensor at the same offset, so HF -> k3jax -> HF gives the same files byte for byte
when the experts were kept as MXFP4 codes (`--experts mxfp4`), and the same values with bf16
experts (re-quantised, see mxfp4.quantize). A checkpoint without a manifest (trained in k3jax)
gets the official layout from the name map: K3 names with MXFP4 experts (or Kimi-Linear names,
bf16 experts, for a model without AttnRes), contiguous layer ranges per shard (a layer is never
split; the embedding in the first shard, norm / output AttnRes / head in the last).
Tensors are produced one at a time from slices of the checkpoint arrays.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import ml_dtypes
import numpy as np

from convert import orbax_io
from convert.load import checkpoint_config, read_manifest
from convert.lora_export import Merger
from convert.name_map import DIALECTS, PACKED, SCALE, Slot, full_name, hf_shape, slots
from convert.outdir import staged
from convert.progress import Progress
from convert.safetensors_io import DTYPES, ShardWriter, encode_header
from convert.source import INDEX, SINGLE
from convert.to_orbax import HF_DIR, packed_paths
from convert.variables import param_shapes
from k3jax.config import ModelConfig
from k3jax.errors import CheckpointError
from k3jax.hf_config import to_hf_config
from pallas_kernels import mxfp4

SHARD_BYTES = 5 << 30  # default shard size when the source's sharding is unknown


class _Producer:
  """Makes each HF tensor from the checkpoint arrays (one slice read per k3jax array)."""

  def __init__(self, directory: str, cfg: ModelConfig, codes: bool, merge=None):
    self.directory, self.cfg, self.codes = directory, cfg, codes
    self.merge = merge  # convert.lora_export.Merger: adapters folded into the weights
    self._stores: dict = {}
    self._quantized: tuple[str, tuple[np.ndarray, np.ndarray]] | None = None

  def _read(self, path, index) -> np.ndarray:
    if self.merge is not None:
      return self.merge.read(path, index, self._read_saved)
    return self._read_saved(path, index)

  def _read_saved(self, path, index) -> np.ndarray:
    if path not in self._stores:
      self._stores[path] = orbax_io.open_array(self.directory, path)
    return np.asarray(self._stores[path][index].read().result())

  def weight(self, slot: Slot) -> np.ndarray:
    arrays = tuple(self._read(p, slot.index) for p in slot.entry.paths)
    return slot.entry.to_hf(arrays, self.cfg)

  def tensor(self, slot: Slot, kind: str, dtype: str) -> np.ndarray:
    if kind == "weight":
      return _cast(self.weight(slot), dtype, slot.hf_name)
    if self.codes:  # kept codes: copied as they are
      codes, scales = packed_paths(slot.entry.paths[0])
      return self._read(codes if kind == "packed" else scales, slot.index)
    if self._quantized is None or self._quantized[0] != slot.hf_name:
      self._quantized = (slot.hf_name, mxfp4.quantize_np(self.weight(slot)))
    return self._quantized[1][0 if kind == "packed" else 1]


def _cast(a: np.ndarray, dtype: str, name: str) -> np.ndarray:
  target = DTYPES[dtype]
  if a.dtype == target:
    return a
  if not np.issubdtype(target, np.floating) and target != ml_dtypes.bfloat16:
    raise CheckpointError(f"tensor {name}: cannot write a float weight as {dtype}")
  if target == ml_dtypes.bfloat16 and a.dtype == np.float64:
    # through float32, as torch's and XLA's float64 -> bf16 conversions round (twice):
    # ml_dtypes >= 0.7 rounds float64 straight to bf16, which differs on a few values
    # (docs/benchmarks.md#development-measurements)
    a = a.astype(np.float32)
  return a.astype(target)  # float -> bf16 rounds to nearest even (ml_dtypes)


def _names(cfg: ModelConfig, dialect) -> dict[str, tuple[Slot, str]]:
  """Every tensor name the model can be written as -> (slot, weight | packed | scale)."""
  out = {}
  for slot in slots(cfg):
    for stem in slot.names:
      name = full_name(stem, dialect)
      out[name] = (slot, "weight")
      if slot.entry.mxfp4:
        base = name.removesuffix(".weight")
        out[base + PACKED] = (slot, "packed")
        out[base + SCALE] = (slot, "scale")
  return out


def _fresh_layout(cfg: ModelConfig, shapes, num_shards: int | None):
  """(dialect, [(file, header bytes)]) of the official layout for a checkpoint without one."""
  dialect = DIALECTS["k3" if cfg.attn_res_block_size is not None else "kimi_linear"]
  quantize = dialect.name == "k3"
  tensors = []  # (name, dtype, shape, layer)
  for slot in slots(cfg):
    name, e = full_name(slot.hf_name, dialect), slot.entry
    shape = hf_shape(e, cfg, shapes)
    if e.mxfp4 and quantize:
      base = name.removesuffix(".weight")
      tensors.append((base + PACKED, "U8", (shape[0], shape[1] // 2), slot.layer))
      tensors.append((base + SCALE, "U8", (shape[0], shape[1] // mxfp4.GROUP), slot.layer))
    else:
      tensors.append((name, "F32" if e.hf_dtype == "f32" else "BF16", shape, slot.layer))
  size = lambda t: math.prod(t[2]) * DTYPES[t[1]].itemsize
  total = sum(map(size, tensors))
  n = num_shards or max(1, math.ceil(total / SHARD_BYTES))
  n = max(1, min(n, cfg.num_layers))
  layer_bytes = np.zeros(cfg.num_layers)
  for t in tensors:
    if t[3] is not None:
      layer_bytes[t[3]] += size(t)
  embed = sum(size(t) for t in tensors if t[3] is None and "embed_tokens" in t[0])
  # A layer goes to the shard its byte midpoint falls in: contiguous ranges, balanced sizes.
  mid = embed + np.cumsum(layer_bytes) - layer_bytes / 2
  shard_of_layer = np.minimum((mid / max(total, 1) * n).astype(int), n - 1)
  groups: list[list] = [[] for _ in range(n)]
  for t in tensors:
    if t[3] is not None:
      groups[shard_of_layer[t[3]]].append(t)
    else:
      groups[0 if "embed_tokens" in t[0] else n - 1].append(t)
  groups = [g for g in groups if g]
  files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
  if len(groups) == 1:
    files = [SINGLE]
  return dialect, [(f, encode_header([t[:3] for t in g], {"format": "pt"}))
                   for f, g in zip(files, groups)], len(groups) == 1


def export(ckpt_dir: str, out_dir: str, *, force: bool = False, progress: bool = True,
           num_shards: int | None = None, merge_lora: bool = False) -> dict:
  """Write the official layout of the checkpoint at `ckpt_dir` into `out_dir`; with
  `merge_lora`, a fine-tuned model's adapters folded in (convert/lora_export.py)."""
  if not os.path.isdir(ckpt_dir):
    raise CheckpointError(f"{ckpt_dir}: not a folder")
  cfg = checkpoint_config(ckpt_dir)
  manifest = read_manifest(ckpt_dir) or {}
  if manifest.get("layers") is not None:
    a, b = manifest["layers"]
    raise CheckpointError(f"{ckpt_dir} holds layers {a}-{b} only (converted with --layers): "
                          "export needs the whole model")
  saved = orbax_io.saved_paths(ckpt_dir)
  codes = any(p[-1].endswith("_packed") for p in saved)
  merge = None
  if merge_lora:
    merge = Merger(ckpt_dir, saved)
    codes = codes and not merge.changes_experts  # changed experts are re-quantised
  elif any(p[-1].startswith("lora") or "_lora_" in p[-1] for p in saved):
    raise CheckpointError(f"{ckpt_dir} holds LoRA adapters: export with --merge-lora (or "
                          "--adapter-only)")
  shapes = param_shapes(cfg)
  recorded = (manifest.get("source") or {}).get("shards")
  if recorded and num_shards is None:
    dialect = DIALECTS[manifest["dialect"]]
    single = manifest["source"].get("single_file", False)
    layout = [(s["file"], s["header"].encode("utf-8")) for s in recorded]
  else:
    dialect, layout, single = _fresh_layout(cfg, shapes, num_shards)
  names = _names(cfg, dialect)
  producer = _Producer(ckpt_dir, cfg, codes, merge)

  headers = []
  for file, raw in layout:
    parsed = json.loads(raw)
    meta = parsed.pop("__metadata__", None)
    unknown = [k for k in parsed if k not in names]
    if unknown:  # e.g. vision tensors sharing a shard: write the shard without them
      kept = [(k, v["dtype"], tuple(v["shape"])) for k, v in parsed.items() if k in names]
      raw = encode_header(kept, meta)
      parsed = {k: v for k, v in parsed.items() if k in names}
    headers.append((file, raw, parsed))
  covered = {n: file for file, _, parsed in headers for n in parsed}
  for slot in slots(cfg):  # every model tensor must be written somewhere
    spellings = [full_name(s, dialect) for s in slot.names]
    base = spellings[0].removesuffix(".weight")
    if not any(s in covered for s in spellings) and base + PACKED not in covered:
      raise CheckpointError(f"the recorded layout has no place for {spellings[0]}")
    if codes and slot.entry.mxfp4 and base + PACKED not in covered:
      raise CheckpointError(f"{spellings[0]}: the checkpoint holds MXFP4 codes, the layout "
                            "wants a dense weight (convert with --experts bf16)")

  total = sum(v["data_offsets"][1] - v["data_offsets"][0]
              for _, _, parsed in headers for v in parsed.values())
  with staged(out_dir, force=force, inputs=(ckpt_dir,)) as tmp:
    bar = Progress(total, "export", enabled=progress)
    for file, raw, parsed in headers:
      os.makedirs(os.path.dirname(os.path.join(tmp, file)), exist_ok=True)
      writer = ShardWriter(os.path.join(tmp, file), raw)
      for name, info in sorted(parsed.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        slot, kind = names[name]
        array = producer.tensor(slot, kind, info["dtype"])
        writer.write(name, array)
        bar.update(info["data_offsets"][1] - info["data_offsets"][0])
      writer.close()
    bar.close()
    if not single:
      index_meta = dict((manifest.get("source") or {}).get("index_metadata") or {})
      index_meta["total_size"] = total
      index = {"metadata": index_meta, "weight_map": dict(sorted(covered.items()))}
      with open(os.path.join(tmp, INDEX), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _write_config(ckpt_dir, tmp, cfg, dialect, codes or dialect.name == "k3")
  return {"files": [f for f, _, _ in headers], "total_size": total, "dialect": dialect.name}


def _write_config(ckpt_dir: str, out: str, cfg: ModelConfig, dialect, mxfp4_experts: bool):
  side = os.path.join(ckpt_dir, HF_DIR)
  if os.path.isdir(side):
    for name in sorted(os.listdir(side)):
      shutil.copyfile(os.path.join(side, name), os.path.join(out, name))
  if os.path.exists(os.path.join(out, "config.json")):
    return
  text = to_hf_config(cfg)
  if dialect.name != "k3":
    config = {"architectures": ["KimiLinearForCausalLM"], **text}
  else:
    if mxfp4_experts:
      text["quantization_config"] = _mxfp4_quantization_config()
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
              "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": cfg.tie_word_embeddings,
              "torch_dtype": "bfloat16", "text_config": text}
  with open(os.path.join(out, "config.json"), "w") as f:
    f.write(json.dumps(config, indent=2) + "\n")


def _mxfp4_quantization_config() -> dict:
  """The compressed-tensors block of the official release: MXFP4 routed experts only."""
  return {
      "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {
          "format": "mxfp4-pack-quantized",
          "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
          "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                      "group_size": 32, "dynamic": False, "observer": "minmax",
                      "scale_dtype": "torch.uint8", "actorder": None,
                      "block_structure": None, "observer_kwargs": {}},
          "input_activations": None, "output_activations": None}},
      "ignore": [r"re:.*self_attn.*", r"re:.*shared_experts.*",
                 r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", r"re:.*lm_head.*",
                 r"re:.*vision_tower.*", r"re:.*mm_projector.*"],
      "kv_cache_scheme": None,
  }
