"""`k3jax convert`: an official-layout folder -> an Orbax checkpoint of the k3jax tree, streaming.

    OUT_DIR/
      _METADATA, <variable>.value/      the Orbax checkpoint (see orbax_io)
      k3jax_config.json                 {"format": "k3jax", "config": ...} (configs.resolve)
      k3jax_convert.json                the manifest: dialect, expert storage, layers held, and
                                        each source shard's header (names, order, dtypes) so
                                        export can write the very same files back
      hf/config.json (+ tokenizer files) copied verbatim for export

Tensors are read one at a time in (shard, offset) order and written straight into their slice
of the stacked arrays; peak memory is one tensor plus the bounded write queue.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil

import ml_dtypes
import numpy as np

from convert import orbax_io
from convert.errors import CheckpointError
from convert.hf_load import abstract_state
from convert.name_map import ENTRIES
from convert.outdir import staged
from convert.progress import Progress
from convert.safetensors_io import DTYPES
from convert.source import Item, layer_range, open_source, plan, read_weight, to_k3jax

MANIFEST = "k3jax_convert.json"
CONFIG = "k3jax_config.json"
HF_DIR = "hf"
# Small files a model folder carries besides the weights (tokenizer, generation defaults).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer*", "*.tiktoken",
              "tiktoken.model", "tokenization*.py", "special_tokens_map.json", "chat_template*")
SIDE_FILE_LIMIT = 64 << 20


def packed_paths(path: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Where an expert weight's MXFP4 codes and scales live in a `--experts mxfp4` checkpoint."""
  return (*path[:-1], path[-1] + "_packed"), (*path[:-1], path[-1] + "_scale")


def _storage_dtypes(items: list[Item], dequantize: bool) -> dict[tuple[str, ...], np.dtype]:
  """The on-disk dtype of each k3jax array: its source dtype (the widest, should layers
  differ), so the checkpoint holds exactly the source values; dequantised MXFP4 is bf16."""
  out: dict[tuple[str, ...], np.dtype] = {}
  for it in items:
    dtype = (np.dtype(ml_dtypes.bfloat16) if it.mxfp4 and dequantize
             else DTYPES[it.parts[0].info.dtype])
    for path in it.slot.entry.paths:
      out[path] = np.promote_types(out[path], dtype) if path in out else dtype
  return out


def convert(hf_dir: str, out_dir: str, *, layers: str | None = None, experts: str = "bf16",
            force: bool = False, progress: bool = True) -> dict:
  """Convert; returns the manifest. Raises CheckpointError/ConfigError on bad input."""
  if experts not in ("bf16", "mxfp4"):
    raise CheckpointError(f"--experts {experts!r}: choose bf16 or mxfp4")
  source = open_source(hf_dir)
  cfg = source.cfg
  selected = layer_range(layers, cfg)
  variables = abstract_state(cfg)
  shapes = {p: tuple(v.shape) for p, v in variables.items()}
  # globals: the embedding belongs with layer 0, the head with the last layer (a prefix
  # converts what a partial download of the first shards holds).
  with_embed = selected is None or selected.start == 0
  with_head = selected is None or selected.stop == cfg.num_layers
  items = plan(source, selected, shapes=shapes, keep=lambda s: s.layer is not None or (
      with_embed if s.entry.hf == "embed_tokens.weight" else with_head))
  keep_codes = experts == "mxfp4"
  if keep_codes:
    dense = next((it for it in items if it.slot.entry.mxfp4 and not it.mxfp4), None)
    if dense is not None:
      raise CheckpointError(f"--experts mxfp4 needs MXFP4 experts, but {dense.name} is stored "
                            f"as {dense.parts[0].info.dtype}")
  dtypes = _storage_dtypes(items, dequantize=not keep_codes)

  with staged(out_dir, force=force, inputs=(hf_dir,)) as tmp:
    writer = orbax_io.CheckpointWriter(tmp)
    _create_arrays(writer, cfg, variables, dtypes, keep_codes)
    bar = Progress(sum(it.nbytes for it in items), "convert", enabled=progress)
    for it in items:
      _copy(source, it, writer, keep_codes)
      bar.update(it.nbytes)
    writer.finish()
    bar.close()
    source.reader.close()

    manifest = _manifest(source, items, selected, with_embed, with_head, experts)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
      json.dump(manifest, f)
    with open(os.path.join(tmp, CONFIG), "w") as f:
      json.dump({"format": "k3jax", "config": cfg.to_dict()}, f, indent=2)
    _copy_side_files(source.folder, os.path.join(tmp, HF_DIR))
  return manifest


def _create_arrays(writer, cfg, variables, dtypes, keep_codes) -> None:
  """Every array of the tree at its full stacked shape, before any tensor is read."""
  entry_of = {path: e for e in ENTRIES if e.when(cfg) for path in e.paths}
  for path, var in variables.items():
    if path not in entry_of:
      raise CheckpointError(f"k3jax parameter {'.'.join(path)} has no entry in the name map")
    entry = entry_of[path]
    lead = {"global": 0, "expert": 2}.get(entry.scope, 1)  # stack axes before the tensor's
    if keep_codes and entry.mxfp4:
      n_moe, n_exp, fan_in, fan_out = var.shape
      codes, scales = packed_paths(path)
      writer.create(codes, (n_moe, n_exp, fan_out, fan_in // 2), np.uint8, lead)
      writer.create(scales, (n_moe, n_exp, fan_out, fan_in // 32), np.uint8, lead)
      continue
    # layers outside --layers: no source tensor seen, so the official dtype of the entry
    default = np.dtype(ml_dtypes.bfloat16 if entry.hf_dtype == "bf16" else np.float32)
    writer.create(path, var.shape, dtypes.get(path, default), lead)


def _copy(source, it: Item, writer, keep_codes: bool) -> None:
  """One HF tensor (or MXFP4 pair) into its slice(s) of the checkpoint arrays."""
  if keep_codes and it.mxfp4:
    for part, dest in zip(it.parts, packed_paths(it.slot.entry.paths[0])):
      writer.write(dest, it.slot.index, source.reader.read(part.path, part.info.name))
    return
  arrays = to_k3jax(it, read_weight(source, it), source.cfg)
  for path, arr in zip(it.slot.entry.paths, arrays):
    writer.write(path, it.slot.index, arr)


def _manifest(source, items, selected, with_embed, with_head, experts) -> dict:
  shard_paths = sorted({p.path for it in items for p in it.parts})
  shards = []
  for path in shard_paths:
    header = source.header(path)
    shards.append({"file": os.path.relpath(path, os.path.realpath(source.folder)),
                   "header": header.raw.decode("utf-8")})
  return {
      "format": "k3jax-convert", "version": 1,
      "dialect": source.dialect.name,
      "experts": experts,
      "layers": None if selected is None else [selected.start, selected.stop - 1],
      "embedding": with_embed, "head": with_head,
      "source": {"index_metadata": source.index_metadata,
                 "single_file": source.index_metadata is None and
                 source.shard_files == ("model.safetensors",),
                 "shards": shards},
  }


def _copy_side_files(folder: str, dest: str) -> None:
  os.makedirs(dest, exist_ok=True)
  for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    if (any(fnmatch.fnmatch(name, pat) for pat in SIDE_FILES) and os.path.isfile(path)
        and not os.path.islink(path) and os.path.getsize(path) <= SIDE_FILE_LIMIT):
      shutil.copyfile(path, os.path.join(dest, name))
