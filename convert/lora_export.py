"""Export of a LoRA fine-tuned model (`k3jax train --lora` writes OUT/model with adapters.json).

    k3jax export OUT/model HF_DIR --merge-lora     official layout, W' = W + (alpha/r) A B
    k3jax export OUT/model DIR --adapter-only      adapter_model.safetensors + adapter_config.json

Merging reuses `k3jax export` (convert/to_hf.py) whole: the `Merger` sits under its array
reads and hands back each weight slice with its adapter folded in, in float64; export then
writes the official dtypes (bf16 matrices, routed experts re-quantised to MXFP4 with
convert/mxfp4.quantize, exactly what `--experts-qat` trained through). Routed experts held as
MXFP4 codes (`--base-experts mxfp4`) are dequantised for the sum, or copied as they are when no
adapter touches them.

The adapter file keeps the k3jax parameter tree: one tensor per adapter factor, named by its
k3jax path (`mla.q_b_proj.lora.lora_a` [layers, in, r], `moe.experts.w1_lora_b` [layers, E, r,
out]), float32, stacked over the layers of its kind; a projection's A and B act on its
flattened input and output dims (model/lora.py).
"""

from __future__ import annotations

import json
import os

import numpy as np

from convert import orbax_io
from convert.load import checkpoint_config
from convert.outdir import staged
from convert.safetensors_io import ShardWriter, encode_header
from convert.to_orbax import packed_paths
from k3jax.errors import CheckpointError
from pallas_kernels import mxfp4

ADAPTERS = "adapters.json"            # written by k3jax train (k3jax/train/checkpoint.py)
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_spec(ckpt_dir: str) -> dict:
  path = os.path.join(ckpt_dir, ADAPTERS)
  if not os.path.exists(path):
    raise CheckpointError(f"{ckpt_dir}: no {ADAPTERS} (not a `k3jax train --lora` model)")
  with open(path) as f:
    spec = json.load(f)
  if spec.get("rank") is None:
    raise CheckpointError(f"{ckpt_dir}: trained without --lora: nothing to merge")
  return spec


def scale_of(spec: dict) -> float:
  return (spec["alpha"] if spec.get("alpha") is not None else spec["rank"]) / spec["rank"]


def adapter_paths(path: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Where the adapter factors (A, B) of the weight at `path` live."""
  if path[-1] == "kernel":
    return (*path[:-1], "lora", "lora_a"), (*path[:-1], "lora", "lora_b")
  return (*path[:-1], path[-1] + "_lora_a"), (*path[:-1], path[-1] + "_lora_b")


def is_adapter(path: tuple[str, ...]) -> bool:
  return path[-2:-1] == ("lora",) or "_lora_" in path[-1]


class Merger:
  """Array reads of a fine-tuned checkpoint with the adapters folded into the weights."""

  def __init__(self, ckpt_dir: str, saved: dict):
    self.spec = adapter_spec(ckpt_dir)
    self.scale = scale_of(self.spec)
    self.saved = saved
    self.changes_experts = any(is_adapter(p) and p[:2] == ("moe", "experts") for p in saved)

  def read(self, path, index, read_saved) -> np.ndarray:
    if path in self.saved:
      base = read_saved(path, index)
    elif packed_paths(path)[0] in self.saved:  # frozen MXFP4 experts: dequantised (exact)
      codes, scales = (read_saved(p, index) for p in packed_paths(path))
      lead = codes.shape[:-2]
      flat = [mxfp4.dequantize_np(c, s).T for c, s in zip(codes.reshape(-1, *codes.shape[-2:]),
                                                      scales.reshape(-1, *scales.shape[-2:]))]
      base = np.stack(flat).reshape(*lead, 2 * codes.shape[-1], codes.shape[-2])
    else:
      return read_saved(path, index)  # let the plain read name the missing array
    a_path, b_path = adapter_paths(path)
    if a_path not in self.saved:
      return base
    return merged(base, read_saved(a_path, index), read_saved(b_path, index), self.scale)


def merged(base: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
  """base + scale * A @ B in float64 (A [..., in, r], B [..., r, out] over the flattened
  contracted / output dims of a projection kernel, or one expert's [in, out])."""
  delta = np.einsum("...ir,...ro->...io", a.astype(np.float64), b.astype(np.float64))
  return base.astype(np.float64) + scale * delta.reshape(base.shape)


def export_adapters(ckpt_dir: str, out_dir: str, *, force: bool = False) -> dict:
  """Write the adapters of a fine-tuned checkpoint as one safetensors file + a JSON config."""
  spec = adapter_spec(ckpt_dir)
  cfg = checkpoint_config(ckpt_dir)
  saved = orbax_io.saved_paths(ckpt_dir)
  paths = sorted(p for p in saved if is_adapter(p))
  if not paths:
    raise CheckpointError(f"{ckpt_dir}: no adapter arrays")
  arrays = {".".join(p): np.asarray(orbax_io.open_array(ckpt_dir, p).read().result(),
                                    np.float32) for p in paths}
  config = {"format": "k3jax-lora", "rank": spec["rank"], "alpha": spec.get("alpha"),
            "scale": scale_of(spec), "targets": spec["targets"],
            "base_experts": spec.get("base_experts"), "experts_qat": spec.get("qat"),
            "model_type": "kimi_k3" if cfg.attn_res_block_size is not None else "kimi_linear",
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "tensors": {name: list(a.shape) for name, a in arrays.items()}}
  with staged(out_dir, force=force, inputs=(ckpt_dir,)) as tmp:
    header = encode_header([(n, "F32", a.shape) for n, a in arrays.items()], {"format": "k3jax"})
    writer = ShardWriter(os.path.join(tmp, ADAPTER_FILE), header)
    for name, a in arrays.items():
      writer.write(name, a)
    writer.close()
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
      f.write(json.dumps(config, indent=2) + "\n")
  return {"tensors": len(arrays), "params": int(sum(a.size for a in arrays.values()))}
