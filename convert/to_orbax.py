"""`k3jax convert`: an official-layout folder -> an Orbax checkpoint of the k3jax tree, streaming.

    OUT_DIR/
      _CHECKPOINT_METADATA, _METADATA,  the Orbax checkpoint (see orbax_io): one OCDBT database
      manifest.ocdbt, d/, ocdbt.process_0/   holding every variable
      k3jax_config.json                 {"format": "k3jax", "config": ...} (configs.resolve)
      k3jax_convert.json                the manifest: dialect, expert storage, layers held, and
                                        each source shard's header (names, order, dtypes) so
                                        export can write the very same files back
      hf/config.json (+ tokenizer files) copied verbatim for export

Tensors are read one at a time in (shard, offset) order and written straight into their slice
of the stacked arrays; peak memory is one tensor plus two write batches (orbax_io.TXN_BYTES).

Resume: the work happens in `.OUT_DIR.partial` (outdir.resumable), which an interruption
leaves behind. `k3jax_convert.journal` there lists the tensors whose write batch has been
committed; `--resume` skips them and writes the rest into the same arrays, so the result is
the checkpoint an uninterrupted run writes. The folder is renamed to OUT_DIR only once
everything, the Orbax metadata and these json files included, is on disk.

Several processes (jax.distributed, OUT_DIR on a shared file system): the reads are cut into
consecutive runs of about equal bytes (`split_by_bytes`); each process writes its run into its
own OCDBT database (ocdbt.process_<i>/) and journals it in its own file; once all have
committed (`distributed.together`), process 0 merges the databases, writes the files above and
renames the folder. A failure on one process is reported on all.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import json
import math
import os
import shutil

import jax
import ml_dtypes
import numpy as np

from convert import orbax_io
from convert.name_map import ENTRIES
from convert.outdir import resumable
from convert.progress import Progress
from convert.safetensors_io import DTYPES
from convert.source import Item, items_to_read, layer_range, open_source, read_weight, to_k3jax
from convert.variables import abstract_variables
from k3jax.errors import CheckpointError
from sharding import distributed

MANIFEST = "k3jax_convert.json"
CONFIG = "k3jax_config.json"
JOURNAL = "k3jax_convert.journal"  # while converting: tensors whose batch is committed
HF_DIR = "hf"
# Small files a model folder carries besides the weights (tokenizer, generation defaults).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer*", "*.tiktoken",
              "tiktoken.model", "tokenization*.py", "special_tokens_map.json", "chat_template*")
SIDE_FILE_LIMIT = 64 << 20
# How long a process waits for the others at a step of a multi-process conversion: its share
# of a K3 conversion takes hours. A process that fails tells the others at once
# (distributed.together), and JAX's coordination service ends them when one is killed.
PEER_TIMEOUT_S = 24 * 3600.0


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
            force: bool = False, resume: bool = False, progress: bool = True) -> dict:
  """Convert; returns the manifest (plus `resumed`: tensors an interrupted run had already
  written). Raises CheckpointError/ConfigError on bad input."""
  if experts not in ("bf16", "mxfp4"):
    raise CheckpointError(f"--experts {experts!r}: choose bf16 or mxfp4")
  source = open_source(hf_dir)
  cfg = source.cfg
  selected = layer_range(layers, cfg)
  variables = abstract_variables(cfg)
  shapes = {p: tuple(v.shape) for p, v in variables.items()}
  # globals: the embedding belongs with layer 0, the head with the last layer (a prefix
  # converts what a partial download of the first shards holds).
  with_embed = selected is None or selected.start == 0
  with_head = selected is None or selected.stop == cfg.num_layers
  items = items_to_read(
      source, selected, shapes=shapes, keep=lambda s: s.layer is not None or (
          with_embed if s.entry.hf == "embed_tokens.weight" else with_head))
  keep_codes = experts == "mxfp4"
  if keep_codes:
    dense = next((it for it in items if it.slot.entry.mxfp4 and not it.mxfp4), None)
    if dense is not None:
      raise CheckpointError(f"--experts mxfp4 needs MXFP4 experts, but {dense.name} is stored "
                            f"as {dense.parts[0].info.dtype}")
  arrays = _arrays(cfg, variables, _storage_dtypes(items, dequantize=not keep_codes),
                   keep_codes)
  manifest = _manifest(source, items, selected, with_embed, with_head, experts)

  count, me = jax.process_count(), jax.process_index()
  mine = split_by_bytes(items, count)[me]
  key = _resume_key(manifest, source.config_raw) | ({"processes": count} if count > 1 else {})
  together = (functools.partial(distributed.together, timeout_s=PEER_TIMEOUT_S) if count > 1
              else None)
  with _together(together, "convert_placed"), resumable(
      out_dir, force=force, resume=resume, inputs=(hf_dir,), key=key, main=me == 0,
      **({"together": together} if together else {})) as tmp:
    journal = os.path.join(tmp, journal_name(me, count))
    done = _journalled(journal)
    todo = [it for it in mine if it.name not in done]
    label = "convert" if count == 1 else f"convert {me}/{count}"
    bar = Progress(sum(it.nbytes for it in todo), label, enabled=progress)
    with _together(together, "convert_written"), open(journal, "a") as log:
      def committed(names: list[str]) -> None:
        log.write("".join(f"{n}\n" for n in names))
        log.flush()
      stream = orbax_io.Stream(_items(source, todo, arrays, keep_codes, bar), committed)
      started = orbax_io.write_checkpoint(tmp, arrays, stream, finish=count == 1,
                                          every_array_written=selected is None)
    bar.close()
    source.reader.close()
    with _together(together, "convert_finished"):
      if me == 0:
        if count > 1:  # every process's database is on disk: merge them into one
          orbax_io.finish_checkpoint(tmp, started, every_array_written=selected is None)
        _write_side(tmp, source, manifest, cfg)
        for i in range(count):  # last: a resume from before this has nothing left to convert
          os.remove(os.path.join(tmp, journal_name(i, count)))
        orbax_io.sync_tree(tmp)
  return {**manifest, "resumed": len(mine) - len(todo), "tensors": len(mine),
          "bytes_read": source.reader.bytes_read, "process": me, "processes": count}


def _together(together, name: str):
  return contextlib.nullcontext() if together is None else together(name)


def split_by_bytes(items: list[Item], count: int) -> list[list[Item]]:
  """`items` (in source order) cut into `count` consecutive runs of about equal bytes: item k
  goes to the process whose 1/count of the total holds the middle of its bytes, so each
  process reads its own stretch of the shards front to back."""
  total = max(sum(it.nbytes for it in items), 1)
  out: list[list[Item]] = [[] for _ in range(count)]
  before = 0
  for it in items:
    out[min(count - 1, (2 * before + it.nbytes) * count // (2 * total))].append(it)
    before += it.nbytes
  return out


def journal_name(process: int, count: int) -> str:
  """Each process journals the tensors it has committed in its own file."""
  return JOURNAL if count == 1 else f"k3jax_convert.process_{process}.journal"


def _write_side(tmp: str, source, manifest: dict, cfg) -> None:
  """The k3jax files beside the Orbax checkpoint: manifest, config, the folder's side files."""
  with open(os.path.join(tmp, MANIFEST), "w") as f:
    json.dump(manifest, f)
  with open(os.path.join(tmp, CONFIG), "w") as f:
    json.dump({"format": "k3jax", "config": cfg.to_dict()}, f, indent=2)
  _copy_side_files(source.folder, os.path.join(tmp, HF_DIR))


def _arrays(cfg, variables, dtypes, keep_codes) -> dict:
  """path -> (shape, dtype, leading stack axes) of every array of the checkpoint."""
  entry_of = {path: e for e in ENTRIES if e.when(cfg) for path in e.paths}
  out = {}
  for path, var in variables.items():
    if path not in entry_of:
      raise CheckpointError(f"k3jax parameter {'.'.join(path)} has no entry in the name map")
    entry = entry_of[path]
    lead = {"global": 0, "expert": 2}.get(entry.scope, 1)  # stack axes before the tensor's
    if keep_codes and entry.mxfp4:
      n_moe, n_exp, fan_in, fan_out = var.shape
      codes, scales = packed_paths(path)
      out[codes] = ((n_moe, n_exp, fan_out, fan_in // 2), np.uint8, lead)
      out[scales] = ((n_moe, n_exp, fan_out, fan_in // 32), np.uint8, lead)
      continue
    # layers outside --layers: no source tensor seen, so the official dtype of the entry
    default = np.dtype(ml_dtypes.bfloat16 if entry.hf_dtype == "bf16" else np.float32)
    out[path] = (tuple(var.shape), dtypes.get(path, default), lead)
  return out


def _items(source, items: list[Item], arrays: dict, keep_codes: bool, bar: Progress):
  """Each HF tensor (or MXFP4 pair) as a stream item: its key, its size as stored, and how to
  read it laid out for its slice(s) of the checkpoint (read only when the writer asks)."""
  for it in items:
    if keep_codes and it.mxfp4:
      dests = packed_paths(it.slot.entry.paths[0])

      def read(it=it, dests=dests):
        return [(dest, it.slot.index, source.reader.read(part.path, part.info.name))
                for part, dest in zip(it.parts, dests)]
    else:
      dests = it.slot.entry.paths

      def read(it=it, dests=dests):
        return list(zip(dests, [it.slot.index] * len(dests),
                        to_k3jax(it, read_weight(source, it), source.cfg)))
    nbytes = sum(math.prod(arrays[p][0][arrays[p][2]:]) * np.dtype(arrays[p][1]).itemsize
                 for p in dests)
    yield it.name, nbytes, read
    bar.update(it.nbytes)


def _journalled(path: str) -> set[str]:
  """Tensors whose batch was committed before an interruption (a torn last line is not)."""
  if not os.path.exists(path):
    return set()
  with open(path) as f:
    text = f.read()
  return set(text.split("\n")[:-1])


def _resume_key(manifest: dict, config_raw: bytes) -> dict:
  """What a resumed conversion must match: the manifest (layers, expert storage, every source
  shard's name and header, so the same tensors at the same offsets), config.json, and the
  writer's chunk and node sizes."""
  digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
  return {"manifest_sha256": digest.hexdigest(),
          "config_sha256": hashlib.sha256(config_raw).hexdigest(),
          # the arrays on disk must be reopened exactly as they were created
          "chunk_bytes": orbax_io.CHUNK_BYTES, "node_bytes": orbax_io.NODE_BYTES}


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
