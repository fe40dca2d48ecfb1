"""A prepared dataset opened for reading: documents by index, lazily.

Opening reads manifest.json and checks it (manifest.read_complete: its fingerprint, every
shard present at its recorded size); no shard is opened until one of its documents is read,
and at most MAX_OPEN readers stay open (least recently used closed first), so start-up time
and memory do not grow with the corpus: what is held per shard is one integer (its first
document's index).

Documents are numbered 0..N-1 in shard order. The hold-out rule (holdout.py, `every` from the
manifest) splits them: held-out document h is number h * every + every // 2, trained document
j the j-th of the others.
"""

from __future__ import annotations

import bisect
import collections
import copy
import os
from collections.abc import Sequence

import numpy as np

from k3jax.corpus import manifest as manifest_lib
from k3jax.corpus.holdout import held_out_item, train_item
from k3jax.corpus.shards import ShardReader

MAX_OPEN = 64


class PreparedDataset:

  def __init__(self, folder: str):
    self.folder = os.path.abspath(folder)
    self.manifest = manifest_lib.read_complete(self.folder)
    m = self.manifest
    self.fingerprint: str = m["fingerprint"]
    self.tokenizer: dict = m["tokenizer"]
    self.documents: int = m["documents"]
    self.tokens: int = m["tokens"]
    self.every: int = m["held_out"]["every"]
    self.held_out: int = m["held_out"]["documents"]
    self.train_documents = self.documents - self.held_out
    self._first = np.cumsum([0] + [s["documents"] for s in m["shards"]]).tolist()
    self._open: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()

  @property
  def mean_document_tokens(self) -> float:
    return self.tokens / max(self.documents, 1)

  def train_index(self, j: int) -> int:
    """The document number of trained document j (0 <= j < train_documents)."""
    return train_item(j, self.every)

  def held_out_index(self, h: int) -> int:
    return held_out_item(h, self.every)

  def _reader(self, shard: int) -> ShardReader:
    reader = self._open.pop(shard, None)
    if reader is None:
      entry = self.manifest["shards"][shard]
      reader = ShardReader(os.path.join(self.folder, entry["file"]), entry["documents"],
                           self.manifest["token_dtype"])
      if len(self._open) >= MAX_OPEN:
        self._open.popitem(last=False)[1].close()
    self._open[shard] = reader
    return reader

  def read(self, indices: Sequence[int]) -> list[np.ndarray]:
    """Documents `indices` (int32 ids), in that order; one read per shard touched."""
    by_shard: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for at, i in enumerate(indices):
      if not 0 <= i < self.documents:
        raise IndexError(f"document {i} of {self.documents}")
      shard = bisect.bisect_right(self._first, i) - 1
      by_shard[shard].append((at, i - self._first[shard]))
    out: list[np.ndarray | None] = [None] * len(indices)
    for shard, wanted in by_shard.items():
      for (at, _), doc in zip(wanted, self._reader(shard).read([r for _, r in wanted])):
        out[at] = doc
    return out

  def fresh(self) -> PreparedDataset:
    """The same dataset with readers of its own (one per thread that reads: readers are not
    shared between threads)."""
    other = copy.copy(self)
    other._open = collections.OrderedDict()
    return other

  def close(self) -> None:
    for reader in self._open.values():
      reader.close()
    self._open.clear()

  def __getstate__(self):  # a worker process opens its own readers
    return {**self.__dict__, "_open": collections.OrderedDict()}
