"""safetensors files: a strict header check before any read, and a streaming writer.

Reading goes through `safetensors.safe_open` (never pickle), or, for a box of a tensor
(`ShardReader.read_box`, the per-host streaming load), positioned reads of its bytes at the
offsets the header gives; either only after `read_header` has validated the file against
everything safetensors' own reader requires (the 8-byte header length and its bound, a UTF-8
JSON object, known dtypes, 64-bit sizes that match shapes, tensors tiling the data section
exactly) plus a little more (no duplicate names). So a truncated, damaged or hostile file
fails with one line naming it, not deep inside a reader; an error safetensors still raises (a
file changed after the check) is turned into one too.

Writing streams: `ShardWriter` lays out the header first (names, dtypes, shapes, offsets) and
then takes one tensor at a time, so a shard never has to be in memory at once. Without a
recorded header it orders tensors exactly as `safetensors.numpy.save` does (by dtype, widest
first, then by name) and pads the header with spaces to 8 bytes, so its files are the files
safetensors itself would write; with a recorded header (from the converted source) it
reproduces that header byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Any

import ml_dtypes  # registers bfloat16 with numpy, which safe_open's numpy path needs
import numpy as np
from safetensors import SafetensorError, safe_open

from k3jax.errors import CheckpointError

# safetensors' own limit on the header (the Rust crate refuses larger ones).
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Data order of safetensors' serializer: descending in this (its Dtype enum) order, then name.
_RANK = {name: i for i, name in enumerate(DTYPES)}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  dtype: str               # safetensors name: "BF16", "F32", "U8", ...
  shape: tuple[int, ...]
  begin: int               # data offsets relative to the data section
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Header:
  path: str
  raw: bytes               # the header JSON exactly as stored (with its padding)
  metadata: dict[str, str] | None
  tensors: dict[str, TensorInfo]  # in header order
  data_start: int          # file offset of the data section


def read_header(path: str) -> Header:
  """Parse and validate the header of a safetensors file; CheckpointError names the file.

  Accepts exactly what safetensors' reader accepts (and refuses a few things it would let
  through: duplicate names, unknown fields, dtypes k3jax does not read), so that `safe_open`
  never fails on a file that passed: the header is UTF-8 JSON text, an
  object of tensors (plus an optional `__metadata__` of strings); every size fits in 64 bits;
  each tensor's byte length is its shape times its dtype; and the tensors, sorted by
  offsets, tile the data section exactly: contiguous from 0 to the end of the file.
  """
  name = os.path.basename(path)
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise CheckpointError(f"{name}: not a safetensors file (shorter than 8 bytes)")
      (n,) = struct.unpack("<Q", head)
      if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{name}: header length {n} exceeds the {MAX_HEADER_BYTES} "
                              "byte limit (corrupt or not a safetensors file)")
      if 8 + n > size:
        raise CheckpointError(f"{name}: header length {n} runs past the end of the file "
                              f"({size} bytes): truncated or corrupt")
      raw = f.read(n)
  except OSError as e:
    raise CheckpointError(f"{name}: cannot read ({e.strerror})") from None
  parsed = _parse_json(name, raw)
  metadata = parsed.pop("__metadata__", None)
  if metadata is not None and not (isinstance(metadata, dict) and all(
      isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
    raise CheckpointError(f"{name}: malformed header (__metadata__ must map strings to strings)")
  data_size = size - 8 - n
  tensors: dict[str, TensorInfo] = {}
  for key, info in parsed.items():
    tensors[key] = _tensor_info(name, key, info)
  # safetensors' own rule: sorted by (begin, end), each tensor starts where the last ended
  # (zero-size tensors included), and the last one ends where the file does
  end = 0
  for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
    if t.begin != end:
      what = ("overlaps the one before it" if t.begin < end
              else f"leaves bytes {end}-{t.begin} unused")
      raise CheckpointError(f"{name}: tensor {t.name} at data offset {t.begin} {what}: the "
                            "tensors must fill the data section back to back")
    end = t.end
  if end != data_size:
    if end > data_size:
      raise CheckpointError(f"{name}: the tensors need {end} data bytes, the file holds "
                            f"{data_size}: the file is truncated (or its header length wrong)")
    raise CheckpointError(f"{name}: the tensors cover {end} of the file's {data_size} data "
                          "bytes: wrong header length, or bytes appended to the file")
  return Header(path, raw, metadata, tensors, 8 + n)


_U64 = 1 << 64  # safetensors reads sizes as 64-bit integers


def _unique_object(pairs):
  keys = [k for k, _ in pairs]
  if len(set(keys)) != len(keys):
    dup = next(k for k in keys if keys.count(k) > 1)
    raise _Duplicate(dup)
  return dict(pairs)


class _Duplicate(ValueError):
  pass


def _no_constant(name: str):
  raise ValueError(f"{name} is not JSON")


def _parse_json(name: str, raw: bytes) -> dict:
  """The header object, refused in one line wherever safetensors' serde reader would fail
  (and where Python's json is laxer: NaN, lone surrogates, duplicates, deep nesting)."""
  def bad(why):
    return CheckpointError(f"{name}: malformed header ({why})")
  try:
    text = raw.decode("utf-8")
    parsed = json.loads(text, object_pairs_hook=_unique_object, parse_constant=_no_constant)
  except _Duplicate as e:
    raise bad(f"name {e.args[0]!r} appears twice") from None
  except UnicodeDecodeError as e:
    raise bad(f"not UTF-8: {e.reason} at byte {e.start}") from None
  except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits, nesting
    raise bad(f"not JSON: {str(e).splitlines()[0][:200]}") from None
  if not isinstance(parsed, dict):
    raise bad("not a JSON object")
  _check_strings(name, parsed)
  return parsed


def _check_strings(name: str, value: Any) -> None:
  """JSON escapes can spell lone UTF-16 surrogates, which Python keeps and Rust refuses."""
  stack = [value]
  while stack:
    v = stack.pop()
    if isinstance(v, dict):
      stack.extend(v)
      stack.extend(v.values())
    elif isinstance(v, list):
      stack.extend(v)
    elif isinstance(v, str):
      try:
        v.encode("utf-8")
      except UnicodeEncodeError:
        raise CheckpointError(f"{name}: malformed header (string {v!r} is not valid "
                              "Unicode)") from None


def _tensor_info(file: str, key: str, info: Any) -> TensorInfo:
  bad = f"{file}: malformed header entry for tensor {key}"
  if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
    raise CheckpointError(f"{bad} (needs exactly dtype, shape, data_offsets)")
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if not isinstance(dtype, str) or dtype not in DTYPES:
    raise CheckpointError(f"{bad} (unsupported dtype {dtype!r})")
  if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < _U64 for d in shape)):
    raise CheckpointError(f"{bad} (shape must be a list of non-negative 64-bit integers)")
  if not (isinstance(offsets, list) and len(offsets) == 2
          and all(type(o) is int and 0 <= o < _U64 for o in offsets) and offsets[0] <= offsets[1]):
    raise CheckpointError(f"{bad} (data_offsets must be [begin, end] with 0 <= begin <= end)")
  count = 1
  for d in shape:  # multiplied left to right in 64 bits, as safetensors does
    count *= d
    if count >= _U64:
      raise CheckpointError(f"{bad} (shape {shape} overflows 64 bits)")
  expect = count * DTYPES[dtype].itemsize
  if expect >= _U64:
    raise CheckpointError(f"{bad} (shape {shape} overflows 64 bits)")
  begin, end = offsets
  if end - begin != expect:
    raise CheckpointError(f"{bad} ({end - begin} data bytes for {dtype} {shape}, "
                          f"which needs {expect})")
  return TensorInfo(key, dtype, tuple(shape), begin, end)


class ShardReader:
  """Reads tensors (or row ranges of them) from validated files through safe_open.

  safe_open memory-maps the file and every page read stays resident in this process until
  the map goes away, so a handle is reopened after `recycle_bytes` read through it: a handle
  per shard for ~16k K3 tensors (re-parsing a header is cheap), yet resident memory bounded
  by the tensors in use rather than by the shard.
  """

  def __init__(self, recycle_bytes: int = 256 << 20):
    self._headers: dict[str, Header] = {}
    self._handles: dict[str, Any] = {}
    self._read: dict[str, int] = {}
    self.recycle_bytes = recycle_bytes
    self.bytes_read = 0  # every tensor byte this reader returned (for tests and benchmarks)

  def header(self, path: str) -> Header:
    if path not in self._headers:
      self._headers[path] = read_header(path)
    return self._headers[path]

  def _handle(self, path: str):
    if path not in self._handles:
      self.header(path)  # validate before safetensors parses the file
      self._handles[path] = safe_open(path, framework="numpy")
    return self._handles[path]

  def read(self, path: str, name: str, rows: slice | None = None) -> np.ndarray:
    """Tensor `name` of file `path` (only rows `rows` of its first axis, when given)."""
    if name not in self.header(path).tensors:
      raise CheckpointError(f"{os.path.basename(path)}: no tensor {name}")
    info = self.header(path).tensors[name]
    try:
      if rows is None and info.nbytes > self.recycle_bytes and len(info.shape) > 0:
        return self._read_in_blocks(path, info)  # never map more than recycle_bytes at once
      handle = self._handle(path)
      out = handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
    except SafetensorError as e:
      # read_header accepts only what safetensors reads, so this is a file that changed
      # after it was checked, or a reader bug: still one line, naming the file
      self._drop(path)
      raise CheckpointError(f"{os.path.basename(path)}: tensor {name}: safetensors: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    self._count(path, out.nbytes)
    return out

  def _read_in_blocks(self, path: str, info: TensorInfo) -> np.ndarray:
    out = np.empty(info.shape, DTYPES[info.dtype])
    row = max(1, info.nbytes // max(info.shape[0], 1))
    step = max(1, self.recycle_bytes // row)
    for r in range(0, info.shape[0], step):
      end = min(r + step, info.shape[0])  # safetensors refuses slices past the end
      block = self._handle(path).get_slice(info.name)[r:end]
      out[r:end] = block
      self._count(path, block.nbytes)
    return out

  def read_box(self, path: str, name: str, box: tuple[slice, ...]) -> np.ndarray:
    """The block `box` (one slice of step 1 per axis; fewer slices: the rest whole) of tensor
    `name`, read with positioned reads of exactly its bytes: one contiguous run per index of
    the leading axes that the box cuts, the trailing axes it takes whole being contiguous on
    disk. No map of the file, so the process holds only the block (plus the page cache)."""
    header = self.header(path)
    if name not in header.tensors:
      raise CheckpointError(f"{os.path.basename(path)}: no tensor {name}")
    info = header.tensors[name]
    bounds = _box_bounds(os.path.basename(path), info, box)
    dtype = DTYPES[info.dtype]
    out = np.empty([b - a for a, b in bounds], dtype)
    if out.size == 0:
      return out
    # axis k is the last one the box cuts (0 if none): the axes after it are whole, so each
    # index of the axes before it is one contiguous run of the file
    cut = [j for j, (a, b) in enumerate(bounds) if (a, b) != (0, info.shape[j])]
    k = cut[-1] if cut else 0
    strides = [math.prod(info.shape[j + 1:]) * dtype.itemsize for j in range(len(bounds))]
    run = (bounds[k][1] - bounds[k][0]) * strides[k] if bounds else dtype.itemsize
    base = header.data_start + info.begin + (bounds[k][0] * strides[k] if bounds else 0)
    flat = out.reshape(-1).view(np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
      for n, idx in enumerate(np.ndindex(*[b - a for a, b in bounds[:k]])):
        offset = base + sum((bounds[j][0] + i) * strides[j] for j, i in enumerate(idx))
        view, done = memoryview(flat[n * run:(n + 1) * run]), 0
        while done < run:  # a positioned read may return less (Linux: at most ~2 GiB)
          got = os.preadv(fd, [view[done:]], offset + done)
          if got == 0:
            raise CheckpointError(f"{os.path.basename(path)}: tensor {name}: the file ends "
                                  "early (changed after it was checked?)")
          done += got
    except OSError as e:
      raise CheckpointError(f"{os.path.basename(path)}: cannot read ({e.strerror})") from None
    finally:
      os.close(fd)
    self.bytes_read += out.nbytes
    return out

  def _count(self, path: str, nbytes: int) -> None:
    self.bytes_read += nbytes
    self._read[path] = self._read.get(path, 0) + nbytes
    if self._read[path] >= self.recycle_bytes:
      self._drop(path)

  def _drop(self, path: str) -> None:
    handle = self._handles.pop(path, None)
    self._read.pop(path, None)
    if handle is not None:
      handle.__exit__(None, None, None)  # unmaps the file

  def close(self) -> None:
    for path in list(self._handles):
      self._drop(path)


def _box_bounds(file: str, info: TensorInfo, box: tuple[slice, ...]) -> list[tuple[int, int]]:
  """(start, stop) per axis of `box` on `info`'s shape; one-line CheckpointError otherwise."""
  if len(box) > len(info.shape):
    raise CheckpointError(f"{file}: tensor {info.name}: a {len(box)}-axis box for a tensor "
                          f"of shape {list(info.shape)}")
  out = []
  for axis, dim in enumerate(info.shape):
    s = box[axis] if axis < len(box) else slice(None)
    if not isinstance(s, slice) or s.step not in (None, 1):
      raise CheckpointError(f"{file}: tensor {info.name}: axis {axis} of the box is {s!r}, "
                            "not a slice of step 1")
    a = 0 if s.start is None else s.start
    b = dim if s.stop is None else s.stop
    if not 0 <= a <= b <= dim:
      raise CheckpointError(f"{file}: tensor {info.name}: box {a}:{b} on axis {axis} leaves "
                            f"its 0:{dim}")
    out.append((a, b))
  return out


# ---- writing ---------------------------------------------------------------------------------

def encode_header(tensors: list[tuple[str, str, tuple[int, ...]]],
                metadata: dict[str, str] | None) -> bytes:
  """The header safetensors would write for these (name, dtype, shape) tensors."""
  order = sorted(tensors, key=lambda t: (-_RANK[t[1]], t[0]))
  header: dict[str, Any] = {}
  if metadata is not None:
    header["__metadata__"] = metadata
  offset = 0
  for name, dtype, shape in order:
    size = math.prod(shape) * DTYPES[dtype].itemsize
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  raw = json.dumps(header, separators=(",", ":")).encode()
  return raw + b" " * (-len(raw) % 8)


def header_from_raw(path: str, raw: bytes) -> Header:
  """A Header object for header bytes that are about to be written (recorded or encoded)."""
  parsed = json.loads(raw)
  metadata = parsed.pop("__metadata__", None)
  tensors = {k: TensorInfo(k, v["dtype"], tuple(v["shape"]), *v["data_offsets"])
             for k, v in parsed.items()}
  return Header(path, raw, metadata, tensors, 8 + len(raw))


class ShardWriter:
  """Writes one safetensors file tensor by tensor, in any order, at their header offsets."""

  def __init__(self, path: str, header_raw: bytes):
    self.header = header_from_raw(path, header_raw)
    self._pending = set(self.header.tensors)
    self._f = open(path, "wb")
    self._f.write(struct.pack("<Q", len(header_raw)))
    self._f.write(header_raw)
    data_size = max((t.end for t in self.header.tensors.values()), default=0)
    self._f.truncate(self.header.data_start + data_size)

  def write(self, name: str, array: np.ndarray) -> None:
    info = self.header.tensors[name]
    if DTYPE_NAMES.get(array.dtype) != info.dtype or tuple(array.shape) != info.shape:
      raise CheckpointError(f"{os.path.basename(self.header.path)}: tensor {name} is "
                            f"{array.dtype} {tuple(array.shape)}, the header says "
                            f"{info.dtype} {list(info.shape)}")
    self._f.seek(self.header.data_start + info.begin)
    # tofile writes the buffer as is: no bytes() copy of a possibly huge tensor
    np.ascontiguousarray(array).reshape(-1).view(np.uint8).tofile(self._f)
    self._pending.discard(name)

  def close(self) -> None:
    self._f.close()
    if self._pending:
      raise CheckpointError(f"{os.path.basename(self.header.path)}: "
                            f"{len(self._pending)} tensors never written, e.g. "
                            f"{sorted(self._pending)[0]}")
