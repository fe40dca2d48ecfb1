"""ArrayRecord shards of token arrays: one record per document, its ids as little-endian
unsigned integers of the manifest's `token_dtype`.

Written with `group_size:1` (each record its own compressed chunk, zstd), so any document is
read alone: the random access Grain-style readers need (a larger group would decompress a
group of documents to read one). A shard is written under a temporary name and renamed into
place once closed and hashed, so a shard file under its final name is always whole.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from k3jax.errors import UserError

WRITER_OPTIONS = "group_size:1"
READER_OPTIONS = "readahead_buffer_size:0"  # random access: no read-ahead
TMP_SUFFIX = ".tmp"


def shard_name(index: int) -> str:
  return f"shard-{index:05d}.array_record"


def token_dtype(vocab_size: int) -> str:
  """The smallest unsigned type that holds every id."""
  for dtype in ("uint8", "uint16", "uint32"):
    if vocab_size <= np.iinfo(dtype).max + 1:
      return dtype
  raise UserError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token ids")


def file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


class ShardWriter:
  """Shard `index` of `folder`, written under a temporary name until `finish`."""

  def __init__(self, folder: str, index: int, dtype: str):
    self.name = shard_name(index)
    self.path = os.path.join(folder, self.name)
    self._tmp = self.path + TMP_SUFFIX
    self._dtype = np.dtype(dtype).newbyteorder("<")
    self._writer = ArrayRecordWriter(self._tmp, WRITER_OPTIONS)
    self.documents = self.tokens = 0

  def write(self, ids: np.ndarray) -> None:
    self._writer.write(np.ascontiguousarray(ids, self._dtype).tobytes())
    self.documents += 1
    self.tokens += len(ids)

  def finish(self) -> dict:
    """Close, hash and move into place; the manifest's entry for the shard."""
    self._writer.close()
    entry = {"file": self.name, "documents": self.documents, "tokens": self.tokens,
             "bytes": os.path.getsize(self._tmp), "sha256": file_sha256(self._tmp)}
    os.replace(self._tmp, self.path)
    return entry

  def abort(self) -> None:
    self._writer.close()
    os.remove(self._tmp)


class ShardReader:
  """Random access to one shard's documents, opened on first use (and checked then against
  the manifest's count)."""

  def __init__(self, path: str, documents: int, dtype: str):
    self.path, self.documents = path, documents
    self._dtype = np.dtype(dtype).newbyteorder("<")
    self._reader = None

  def _open(self) -> ArrayRecordReader:
    if self._reader is None:
      try:
        reader = ArrayRecordReader(self.path, READER_OPTIONS)
      except (RuntimeError, ValueError, OSError) as e:
        raise UserError(f"{self.path}: not a readable ArrayRecord shard ({e})") from None
      if reader.num_records() != self.documents:
        raise UserError(f"{self.path}: holds {reader.num_records()} documents, its manifest "
                        f"says {self.documents}; prepare the dataset again")
      self._reader = reader
    return self._reader

  def read(self, records: Sequence[int]) -> list[np.ndarray]:
    """The documents at `records` (int32 ids), in that order."""
    raw = self._open().read([int(r) for r in records])
    return [np.frombuffer(r, self._dtype).astype(np.int32) for r in raw]

  def close(self) -> None:
    if self._reader is not None:
      self._reader.close()
      self._reader = None

  def __getstate__(self):  # a worker process opens its own
    return {"path": self.path, "documents": self.documents, "_dtype": self._dtype,
            "_reader": None}
