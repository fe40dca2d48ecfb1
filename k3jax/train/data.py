"""Input pipeline of documents held in memory (text files and folders, the default corpus,
chat rows): documents -> tokens -> pieces -> grain first-fit packing -> batches
(docs/training.md#data). A prepared dataset streams its documents instead (prepared_data.py,
k3jax/corpus/stream.py); what both hand the loop is a `ShardOpener` (data shard, saved
position -> batches) read through `ShardIterator`.

A text document's tokens end with the tokenizer's end-of-document id (when it has one, and
from data format version 2 on: inputs.py), so the last pair of every document is trained.

A document of L tokens is cut into pieces of at most T+1 tokens that overlap by one token
(starts 0, T, 2T, ...), so each next-token pair of the document is trained on exactly once.
Pieces are shuffled (seeded), packed first-fit into rows of T+1 tokens (grain gives every piece
its own segment id 1, 2, ...; 0 is padding), and a row becomes

    inputs      = row[:-1]          targets = row[1:]          segment_ids = seg[:-1]
    loss_mask   = (seg[:-1] == seg[1:]) & (seg[:-1] != 0)

so no position is trained to predict across a segment boundary or into padding, and the model,
given `segment_ids`, keeps packed pieces apart (MLA mask, KDA state and conv restarts).

A step's batch has shape [A, b, T]: A micro-batches of b rows (gradient accumulation).
The iterator is resumable: its grain state (a small JSON dict) goes into every checkpoint.

Data shards (docs/sharding.md#multi-host): with `num_shards` S (default 1: one pipeline for the
run) the pieces are dealt out round-robin to S independent pipelines (piece i to shard i mod S,
each shuffled and packed on its own), and shard s supplies rows [s b/S, (s+1) b/S) of every
micro-batch. S is a property of the run, never of the process count: a process reads the shards
that overlap the rows its devices hold and keeps only those rows (`shards_for_rows`,
`ShardIterator`), so the global batch of every step, and the saved data position (one grain state
per shard), are the same on any number of processes. S = 1 is the single pipeline above (every
process packs the whole global batch and keeps its rows: packing is cheap next to a step).

Default corpus: the running interpreter's standard-library `*.py` files (top level of the
stdlib folder, sorted by name), so the embedded default needs no download.

Chat SFT (`--format chat`, chat_data.py): each JSONL row is one conversation rendered with the
checkpoint's chat template, one piece of at most T+1 tokens, with per-token `weights` (1 on
assistant tokens) packed alongside; the loss mask above is further multiplied by the target's
weight, so only assistant tokens are trained.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence

import grain
import numpy as np

from k3jax.corpus.holdout import EVAL_EVERY, is_held_out
from k3jax.corpus.sources import TEXT_SUFFIXES
from k3jax.errors import UserError

MIN_DOCS_FOR_DOC_SPLIT = 2 * EVAL_EVERY


@dataclasses.dataclass(frozen=True)
class Document:
  name: str
  data: bytes
  ends: bool = True  # the document's end (False: a head cut off for the eval split)


def stdlib_documents() -> list[Document]:
  """The top-level `*.py` files of this interpreter's standard library, sorted by name."""
  root = sysconfig.get_path("stdlib")
  files = sorted(glob.glob(os.path.join(root, "*.py")))
  if not files:
    raise UserError(f"no standard-library sources under {root}; pass --data")
  return [Document(os.path.basename(f), _read(f)) for f in files]


def folder_documents(path: str) -> list[Document]:
  """A text file, or every text file under a folder (recursively, sorted relative paths)."""
  if os.path.isfile(path):
    return [Document(os.path.basename(path), _read(path))]
  if not os.path.isdir(path):
    raise UserError(f"--data {path}: no such file or folder")
  found = []
  for dirpath, dirnames, filenames in os.walk(path):
    dirnames.sort()
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    for name in sorted(filenames):
      if name.endswith(TEXT_SUFFIXES):
        full = os.path.join(dirpath, name)
        found.append(Document(os.path.relpath(full, path), _read(full)))
  if not found:
    raise UserError(f"--data {path}: no text files ({', '.join(TEXT_SUFFIXES)})")
  return found


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def split_documents(docs: Sequence[Document]) -> tuple[list[Document], list[Document]]:
  """(train, eval): with >= 32 documents every 16th (positions 8, 24, ...) is held out whole;
  with fewer, the last 1/16 of every document is (so a single big file still has an eval set)."""
  if len(docs) >= MIN_DOCS_FOR_DOC_SPLIT:
    return ([d for i, d in enumerate(docs) if not is_held_out(i)],
            [d for i, d in enumerate(docs) if is_held_out(i)])
  train, held_out = [], []
  for d in docs:
    cut = len(d.data) - len(d.data) // EVAL_EVERY
    train.append(Document(d.name, d.data[:cut], ends=False))
    held_out.append(Document(d.name + "[eval]", d.data[cut:]))
  return train, held_out


def tokenize(docs: Sequence[Document], tokenizer, eos: int | None = None) -> list[np.ndarray]:
  """Each document's ids, `eos` (the end-of-document id; None: nothing) after every one that
  `ends`. Special-token text in a training document is ordinary text, not a control token."""
  out = [tokenizer.encode(d.data, allow_special=False) for d in docs]
  if eos is not None:
    out = [np.append(ids, np.int32(eos)) if d.ends else ids for d, ids in zip(docs, out)]
  vocab = tokenizer.vocab_size
  for d, ids in zip(docs, out):
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
      raise UserError(f"{d.name}: token ids outside [0, {vocab})")
  return out


def pieces(lengths: Sequence[int], seq_len: int) -> np.ndarray:
  """[P, 2] (document, start) of every piece: starts 0, T, 2T, ... while at least two tokens
  (one next-token pair) remain; a piece is doc[start : start + T + 1]."""
  rows = [(i, s) for i, n in enumerate(lengths) for s in range(0, max(n - 1, 0), seq_len)]
  if not rows:
    raise UserError("the corpus has no document with two or more tokens")
  return np.asarray(rows, np.int64)


def rows_to_batch(tokens: np.ndarray, seg: np.ndarray, micro_batches: int,
                  weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Packed rows [A*b, T+1] -> model inputs [A, b, T] (see module docstring). `weights`
  [A*b, T+1]: a position is trained only if its target's weight is nonzero (chat SFT)."""
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  seg_in, seg_next = seg[:, :-1], seg[:, 1:]
  mask = (seg_in == seg_next) & (seg_in != 0)
  if weights is not None:
    mask &= weights[:, 1:] != 0
  batch = {
      "inputs": inputs.astype(np.int32),
      "targets": targets.astype(np.int32),
      "segment_ids": seg_in.astype(np.int32),
      "loss_mask": mask,
  }
  return {k: v.reshape(micro_batches, -1, v.shape[-1]) for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  seq_len: int          # T: positions per row
  batch_rows: int       # rows per optimizer step (A * b)
  micro_batches: int    # A
  seed: int
  num_shards: int = 1   # S independent pipelines, each supplying b / S rows per micro-batch

  def __post_init__(self):
    if (self.batch_rows // self.micro_batches) % self.num_shards:
      raise UserError(f"{self.batch_rows // self.micro_batches} rows per micro-batch do not "
                      f"split into {self.num_shards} data shards")

  @property
  def shard_rows(self) -> int:
    """Rows per step that one shard supplies (A * b / S)."""
    return self.batch_rows // self.num_shards


def _packed(docs_tokens: Sequence[np.ndarray], piece_table: np.ndarray, cfg: PipelineConfig,
            *, shuffle: bool, repeat: bool, rows: int | None = None,
            weights: Sequence[np.ndarray] | None = None,
            keep_remainder: bool = False) -> grain.IterDataset:
  t = cfg.seq_len
  rows = cfg.batch_rows if rows is None else rows
  fields = ("tokens",) if weights is None else ("tokens", "weights")

  def load(row) -> dict[str, np.ndarray]:
    doc, start = int(row[0]), int(row[1])
    piece = {"tokens": docs_tokens[doc][start:start + t + 1]}
    if weights is not None:
      piece["weights"] = weights[doc][start:start + t + 1].astype(np.int32)
    return piece

  ds = grain.MapDataset.source(piece_table)
  if shuffle:
    ds = ds.shuffle(seed=cfg.seed)  # a fresh permutation every epoch (seed, epoch)
  if repeat:
    ds = ds.repeat(None)
  ds = ds.map(load).to_iter_dataset()
  # first fit into as many bins as a step has rows: full pieces fill a bin alone, the short
  # tails of documents share bins; bins are emitted together as one step's rows
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct=dict.fromkeys(fields, t + 1), num_packing_bins=rows, seed=cfg.seed,
      shuffle_bins=shuffle)
  ds = ds.batch(rows, drop_remainder=not keep_remainder)
  a = cfg.micro_batches

  def to_batch(r):
    if len(r["tokens"]) < rows:  # the last, partial eval batch: padding rows (segment 0)
      r = {k: np.concatenate([v, np.zeros((rows - len(v),) + v.shape[1:], v.dtype)])
           for k, v in r.items()}
    return rows_to_batch(r["tokens"], r["tokens_segment_ids"], a, r.get("weights"))
  return ds.map(to_batch)


def train_dataset(docs_tokens: Sequence[np.ndarray], cfg: PipelineConfig,
                  weights: Sequence[np.ndarray] | None = None, *,
                  shard: int = 0) -> grain.IterDataset:
  """Endless, shuffled, packed batches of data shard `shard` ([A, b/S, T]); prefetched on a
  thread so packing overlaps the step. (The prefetch does not disturb resumption: grain's state
  counts consumed batches only.) `weights`: per-token training weights of each sequence (chat
  SFT), packed alongside."""
  if not 0 <= shard < cfg.num_shards:
    raise ValueError(f"shard {shard} of {cfg.num_shards}")
  table = pieces([len(d) for d in docs_tokens], cfg.seq_len)[shard::cfg.num_shards]
  if not len(table):
    raise UserError(f"data shard {shard} of {cfg.num_shards} has no piece; use fewer shards "
                    "or more data")
  ds = _packed(docs_tokens, table, cfg, shuffle=True, repeat=True, rows=cfg.shard_rows,
               weights=weights)
  return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)


# data shard, its saved position (None: the start) -> its batches [A, b/S, T], an iterator
# with get_state() (and close())
ShardOpener = Callable[[int, "dict | None"], Iterator[dict[str, np.ndarray]]]


def in_memory_shards(docs_tokens: Sequence[np.ndarray], cfg: PipelineConfig,
                     weights: Sequence[np.ndarray] | None = None) -> ShardOpener:
  """The data shards of documents held in memory (text folders, chat rows): `train_dataset`."""
  return lambda shard, state: iterate(train_dataset(docs_tokens, cfg, weights, shard=shard),
                                      state)


class ShardIterator:
  """Micro-batch rows [start, stop) (of b) of every step's global batch, cut from the data
  shards that overlap them: [A, stop - start, T]. State: {shard: its saved position} of those
  shards (resumable per shard; the same whichever rows, hence process count, read them)."""

  def __init__(self, open_shard: ShardOpener, cfg: PipelineConfig,
               rows: tuple[int, int] | None = None, state: dict | None = None):
    b = cfg.batch_rows // cfg.micro_batches
    self.rows = (0, b) if rows is None else tuple(rows)
    self.shards = shards_for_rows(cfg, self.rows)
    # offset of the rows kept inside the concatenated shards' rows
    first = self.shards[0] * (b // cfg.num_shards)
    self._keep = slice(self.rows[0] - first, self.rows[1] - first)
    states = {s: None if state is None else _shard_state(state, s) for s in self.shards}
    self._its = {s: open_shard(s, states[s]) for s in self.shards}

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(self._its[s]) for s in self.shards]
    whole = parts[0] if len(parts) == 1 else {
        k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}
    return {k: v[:, self._keep] for k, v in whole.items()}

  def get_state(self) -> dict[str, dict]:
    return {str(s): it.get_state() for s, it in self._its.items()}

  def close(self) -> None:
    for it in self._its.values():
      close = getattr(it, "close", None)
      if close is not None:
        close()


def _shard_state(state: dict, shard: int) -> dict:
  if str(shard) not in state:
    raise UserError(f"the checkpoint holds no data position for data shard {shard} (it has "
                    f"{sorted(state, key=int)}): a checkpoint of another --data-shards")
  return state[str(shard)]


def shards_for_rows(cfg: PipelineConfig, rows: tuple[int, int]) -> list[int]:
  """The data shards that supply (some of) micro-batch rows [start, stop) (of b)."""
  b = cfg.batch_rows // cfg.micro_batches
  per = b // cfg.num_shards
  start, stop = rows
  if not 0 <= start < stop <= b:
    raise ValueError(f"rows [{start}, {stop}) of a {b}-row micro-batch")
  return list(range(start // per, -(-stop // per)))


def shard_writers(cfg: PipelineConfig, rows_by_process: dict[int, tuple[int, int]]
                  ) -> dict[int, int]:
  """shard -> the lowest process that reads it: the one that saves its data position."""
  out: dict[int, int] = {}
  for proc in sorted(rows_by_process):
    for shard in shards_for_rows(cfg, rows_by_process[proc]):
      out.setdefault(shard, proc)
  return out


def eval_batches(docs_tokens: Sequence[np.ndarray], cfg: PipelineConfig, max_batches: int,
                 weights: Sequence[np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
  """The first `max_batches` packed batches of the held-out documents, in order (fixed). With
  `weights` (chat rows, which cannot be cut to fill rows) a last partial batch is padded."""
  table = pieces([len(d) for d in docs_tokens], cfg.seq_len)
  out = []
  for batch in _packed(docs_tokens, table, cfg, shuffle=False, repeat=False, weights=weights,
                       keep_remainder=weights is not None):
    out.append(batch)
    if len(out) == max_batches:
      break
  if not out:
    raise UserError(f"the eval split has fewer than {cfg.batch_rows} rows of "
                    f"{cfg.seq_len + 1} tokens; lower --batch-size / --seq-len or add data")
  return out


def iterate(ds: grain.IterDataset, state: dict | None = None) -> Iterator:
  """An iterator over `ds`, positioned by a saved grain state when given."""
  it = iter(ds)
  if state is not None:
    it.set_state(state)
  return it
