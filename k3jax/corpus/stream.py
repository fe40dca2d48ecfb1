"""One data shard's stream of packed rows from prepared datasets, the same for any number of
processes and of worker processes.

Documents. Component c (a prepared dataset with n_c trained documents) supplies data shard s
of S its trained documents in the order: stream position p is the (s + p S)-th document of the
repeated, per-epoch shuffled order (epoch e = (s + p S) // n_c, a permutation seeded by
seed + l 2^20 + e, l the component's stream slot, c unless a stage carried it over
from an earlier mixture: Grain's index shuffle, or a numpy table for small components, `shuffled`).
The S shards thus split every epoch between them, disjoint. The mixture (mixture.py)
interleaves the components: draw k of the shard is component c's stream position
offsets[c] + (its draw number), `offsets` being where an earlier stage left each component
(0 for a run's first stage).

Groups. Draws [g G, (g+1) G) form group g (G = `group_documents`), packed on their own: each
document cut into pieces of at most T+1 tokens that overlap by one (starts 0, T, 2T, ...: every
next-token pair once, as the folder-of-text path does), pieces placed first-fit into rows of
T+1 tokens in draw order, each with its own segment id (1, 2, ...; 0 is padding). A group is a
pure function of g, so groups are a Grain map dataset: with `workers` > 0 Grain's
multiprocess prefetch packs them in worker processes (worker i packs groups i, i+w, ...,
handed back in order), with 0 a thread does, and the rows come out the same either way.

Batches. The rows of groups g, g+1, ... in order; a batch takes the next `rows` of them. The
data position is (group, row): the next row to hand out. A resume rebuilds the stream at that
group and skips that many rows, whatever the worker count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import grain
import numpy as np
from absl import flags

from k3jax.corpus.mixture import counts
from k3jax.corpus.prepared import PreparedDataset
from k3jax.errors import UserError

GROUP_ROWS = 256          # rows a group is sized to give (from the mean document length)
COMPONENT_SEED_STRIDE = 1 << 20
MAX_EMPTY_GROUPS = 1000   # groups in a row without one next-token pair: the data has none
UNBOUNDED = 1 << 62       # the group dataset's length (an endless stream)
PREFETCH = 2              # groups packed ahead of the one being read
TABLE_BELOW = 4096        # fewer trained documents: the epoch's permutation as a table


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  seq_len: int                    # T
  seed: int
  shard: int                      # s
  num_shards: int                 # S
  group_documents: int            # G
  proportions: tuple[int, ...]    # the mixture's integer proportions (one component: (1,))
  offsets: tuple[int, ...]        # stream positions consumed by earlier stages, per component
  streams: tuple[int, ...] = ()   # each component's seed slot (empty: its index)


def group_documents(components: Sequence[PreparedDataset], props: Sequence[int],
                    seq_len: int) -> int:
  """G: documents that fill about GROUP_ROWS rows, by the mixture's mean document length."""
  mean = sum(p * c.mean_document_tokens for p, c in zip(props, components)) / sum(props)
  return max(1, math.ceil(GROUP_ROWS * (seq_len + 1) / max(mean, 1.0)))


@functools.lru_cache(maxsize=16)
def _permutation(n: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).permutation(n)


def shuffled(q: int, n: int, seed: int) -> int:
  """Position q of a permutation of range(n) fixed by `seed`: Grain's index shuffle (O(1) a
  call, nothing stored), or under TABLE_BELOW documents a numpy permutation table (the index
  shuffle walks a larger range there: about 1 ms a call at 37 documents, 7 us at 10,000)."""
  if n < TABLE_BELOW:
    return int(_permutation(n, seed)[q])
  return grain.experimental.index_shuffle(q, max_index=n - 1, seed=seed, rounds=4)


def component_position(c: int, dataset: PreparedDataset, p: int, spec: StreamSpec) -> int:
  """The document number of component c's stream position p in shard spec.shard."""
  n = dataset.train_documents
  epoch, q = divmod(spec.shard + p * spec.num_shards, n)
  slot = spec.streams[c] if spec.streams else c
  seed = (spec.seed + slot * COMPONENT_SEED_STRIDE + epoch) % 2**32
  return dataset.train_index(shuffled(q, n, seed))


def draws(spec: StreamSpec, start: int, stop: int) -> list[tuple[int, int]]:
  """(component, stream position) of draws [start, stop)."""
  seen = counts(start, spec.proportions)
  out = []
  for k in range(start, stop):
    after = counts(k + 1, spec.proportions)
    c = next(i for i, (a, b) in enumerate(zip(seen, after)) if a != b)
    out.append((c, spec.offsets[c] + seen[c]))
    seen = after
  return out


def pack(docs: Sequence[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
  """Pieces of `docs` first-fit into rows of T+1: {"tokens", "segment_ids"} [R, T+1] int32."""
  cap = seq_len + 1
  pieces = [d[s:s + cap] for d in docs for s in range(0, max(len(d) - 1, 0), seq_len)]
  free = np.zeros(len(pieces), np.int64)  # room left in each row opened so far
  where = []                              # (row, offset, segment id) of each piece
  seg_count = np.zeros(len(pieces), np.int64)
  rows = 0
  for piece in pieces:
    n = len(piece)
    fits = np.flatnonzero(free[:rows] >= n) if n < cap else ()
    row = int(fits[0]) if len(fits) else rows
    if row == rows:
      free[row], rows = cap, rows + 1
    seg_count[row] += 1
    where.append((row, cap - free[row], seg_count[row]))
    free[row] -= n
  tokens = np.zeros((rows, cap), np.int32)
  seg = np.zeros((rows, cap), np.int32)
  for piece, (row, at, sid) in zip(pieces, where):
    tokens[row, at:at + len(piece)] = piece
    seg[row, at:at + len(piece)] = sid
  return {"tokens": tokens, "segment_ids": seg}


class GroupSource:
  """Group index -> its packed rows: a random-access source for `grain.MapDataset.source`."""

  def __init__(self, components: Sequence[PreparedDataset], spec: StreamSpec):
    self.components, self.spec = list(components), spec

  def __len__(self) -> int:
    return UNBOUNDED

  def documents(self, g: int) -> list[tuple[int, int]]:
    """(component, document number) of group g's documents, in draw order."""
    start = g * self.spec.group_documents
    return [(c, component_position(c, self.components[c], p, self.spec))
            for c, p in draws(self.spec, start, start + self.spec.group_documents)]

  def __getitem__(self, g: int) -> dict[str, np.ndarray]:
    chosen = self.documents(int(g))
    docs: list[np.ndarray | None] = [None] * len(chosen)
    for c, dataset in enumerate(self.components):
      at = [i for i, (cc, _) in enumerate(chosen) if cc == c]
      for i, doc in zip(at, dataset.read([chosen[i][1] for i in at])):
        docs[i] = doc
    return pack(docs, self.spec.seq_len)


class RowStream:
  """Batches of `rows` packed rows ({"tokens", "segment_ids"} [rows, T+1]) of one data shard,
  from the data position `state` ({"group", "row"}; None: the start)."""

  def __init__(self, source: GroupSource, rows: int, state: dict | None = None, *,
               workers: int = 0):
    self.rows = rows
    self._group, self._row = (0, 0) if state is None else (int(state["group"]),
                                                           int(state["row"]))
    # one thread packs up to PREFETCH groups ahead (in each worker process, if any); Grain's
    # default read-ahead (hundreds of elements on 16 threads) would hold hundreds of groups
    read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=PREFETCH)
    ds = grain.MapDataset.source(source)[self._group:].to_iter_dataset(read)
    if workers:
      if not flags.FLAGS.is_parsed():  # Grain's worker start reads its absl flags: defaults
        flags.FLAGS.mark_as_parsed()
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers,
                                                       per_worker_buffer_size=PREFETCH))
    self._it = iter(ds)
    self._current = None  # the rows of group self._group

  def _load(self) -> dict[str, np.ndarray]:
    for _ in range(MAX_EMPTY_GROUPS):
      if self._current is None:
        self._current = next(self._it)
      if self._row < len(self._current["tokens"]):
        return self._current
      self._group, self._row, self._current = self._group + 1, 0, None
    raise UserError(f"{MAX_EMPTY_GROUPS} groups of documents without a next-token pair: the "
                    "data has no document of two or more tokens")

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = {"tokens": [], "segment_ids": []}
    need = self.rows
    while need:
      group = self._load()
      take = group["tokens"][self._row:self._row + need]
      for k in parts:
        parts[k].append(group[k][self._row:self._row + len(take)])
      self._row += len(take)
      need -= len(take)
    return {k: np.concatenate(v) for k, v in parts.items()}

  def get_state(self) -> dict:
    return {"group": self._group, "row": self._row}

  def close(self) -> None:
    close = getattr(self._it, "close", None)
    if close is not None:
      close()
