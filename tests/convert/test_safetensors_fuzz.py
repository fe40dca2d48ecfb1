"""Fuzzing the safetensors reader: damaged files are read correctly or refused in one line.

Each case damages a valid file (random byte flips, header lengths, truncation, appended bytes,
and header edits: offsets, shapes, dtypes, duplicate names, missing or extra fields, JSON
that Python parses but Rust does not). The truth for "valid" is safetensors itself:
- `read_header` accepts a file  =>  safetensors opens it, and every tensor read through
  `ShardReader` is the dtype, shape and bytes the header places in the file;
- `read_header` refuses a file  =>  a CheckpointError of one line naming the file; and where
  safetensors would have read it anyway, the reason is one of the few things k3jax is
  stricter about (duplicate names, unknown fields, dtypes it does not read).
No other exception may escape either function.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from convert.safetensors_io import DTYPES, ShardReader, read_header
from k3jax.errors import CheckpointError

CASES = 400
STRICTER = ("appears twice", "needs exactly", "unsupported dtype")


def _base_files():
  rng = np.random.default_rng(0)
  yield save({
      "a.weight": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
      "b.bias": rng.standard_normal(7).astype(np.float32),
      "c.codes": rng.integers(0, 255, (4, 2), dtype=np.uint8),
      "d.empty": np.zeros((0, 4), np.float32),
      "e.scalar": np.array(3.5, np.float64),
  }, metadata={"format": "pt"})
  yield save({"only": np.arange(6, dtype=np.int32).reshape(2, 3)})


def _split(blob):
  (n,) = struct.unpack("<Q", blob[:8])
  return json.loads(blob[8:8 + n]), blob[8 + n:]


def _assemble(header_text: bytes, data: bytes, pad: int = 0) -> bytes:
  header_text += b" " * pad
  return struct.pack("<Q", len(header_text)) + header_text + data


def _edit_header(rng, blob):
  """A structural edit of the JSON header (re-serialized, length recomputed)."""
  header, data = _split(blob)
  names = [k for k in header if k != "__metadata__"]
  name = names[rng.integers(len(names))]
  info = header[name]
  kind = rng.integers(14)
  if kind == 0:
    info["data_offsets"][rng.integers(2)] += int(rng.choice([-8, -2, -1, 1, 2, 8]))
  elif kind == 1:
    info["data_offsets"] = [int(x) for x in rng.integers(0, len(data) + 9, 2)]
  elif kind == 2 and info["shape"]:
    info["shape"][rng.integers(len(info["shape"]))] += int(rng.choice([-1, 1, 2]))
  elif kind == 3:
    info["shape"] = info["shape"] + [int(rng.choice([1, 2, 0]))]
  elif kind == 4:
    info["shape"] = [int(rng.choice([2**63, 2**64, 2**64 + 1, 2**32])), 0, *info["shape"]]
  elif kind == 5:
    info["dtype"] = str(rng.choice(list(DTYPES) + ["F8_E4M3", "Q4", "f32", ""]))
  elif kind == 6:
    info["dtype"] = [1, None, 3.0][rng.integers(3)]
  elif kind == 7:
    del info[str(rng.choice(["dtype", "shape", "data_offsets"]))]
  elif kind == 8:
    info["extra"] = 1
  elif kind == 9:
    header["__metadata__"] = {"format": int(rng.integers(9))}
  elif kind == 10:
    info["shape"] = [float(d) for d in info["shape"]] or [1.0]
  elif kind == 11:
    info["data_offsets"] = info["data_offsets"] + [0]
  text = json.dumps(header).encode()
  if kind == 12:  # a duplicate name, pointing at the same bytes or elsewhere
    dup = json.dumps({name: info})[1:-1].encode()
    text = text[:-1] + b", " + dup + b"}"
  elif kind == 13:  # JSON Python accepts and Rust does not
    trick = [b'NaN', b'Infinity', b'"\\ud800"', b"1" * 5000, b"[" * 5000 + b"]" * 5000]
    text = text[:-1] + b', "x": ' + trick[rng.integers(len(trick))] + b"}"
  return _assemble(text, data, pad=int(rng.integers(0, 8)))


def _damage(rng, blob: bytes) -> bytes:
  kind = rng.integers(7)
  b = bytearray(blob)
  (n,) = struct.unpack("<Q", blob[:8])
  if kind == 0:  # random byte flips anywhere
    for _ in range(rng.integers(1, 4)):
      b[rng.integers(len(b))] ^= 1 << int(rng.integers(8))
  elif kind == 1:  # byte flips in the header text
    for _ in range(rng.integers(1, 3)):
      b[8 + rng.integers(n)] = int(rng.integers(256))
  elif kind == 2:  # wrong header length (the first case: one short)
    delta = int(rng.choice([-1, 1, -8, 8, -n, 2**40, 10**8 + 1]))
    b[:8] = struct.pack("<Q", max(0, n + delta) % 2**64)
  elif kind == 3:  # truncation
    del b[rng.integers(len(b)):]
  elif kind == 4:  # bytes appended
    b += bytes(rng.integers(0, 256, rng.integers(1, 9), dtype=np.uint8))
  elif kind == 5:  # leading whitespace before the JSON object
    text = b"  " + bytes(b[8:8 + n])
    return _assemble(text, bytes(b[8 + n:]))
  else:
    return _edit_header(rng, blob)
  return bytes(b)


def _safetensors_verdict(path):
  """None if safetensors reads every tensor of the file, else its error."""
  try:
    with safe_open(path, "numpy") as f:
      for k in f.keys():
        f.get_tensor(k)
  except SafetensorError as e:
    return str(e) or "SafetensorError"
  return None


def test_damaged_files_are_read_or_refused_in_one_line(tmp_path):
  rng = np.random.default_rng(1234)
  bases = list(_base_files())
  counts = {"read": 0, "refused": 0, "stricter": 0}
  path = str(tmp_path / "shard.safetensors")
  for case in range(CASES):
    blob = _damage(rng, bases[case % len(bases)])
    with open(path, "wb") as f:
      f.write(blob)
    where = f"case {case}: {blob[:120]!r}"
    try:
      header = read_header(path)
    except CheckpointError as e:
      msg = str(e)
      assert msg.startswith("shard.safetensors: ") and "\n" not in msg, (where, msg)
      counts["refused"] += 1
      if _safetensors_verdict(path) is None:
        assert any(s in msg for s in STRICTER), (where, msg)
        counts["stricter"] += 1
      continue
    assert _safetensors_verdict(path) is None, where
    reader = ShardReader()
    for name, info in header.tensors.items():
      got = reader.read(path, name)
      assert got.dtype == DTYPES[info.dtype] and got.shape == info.shape, (where, name)
      start = header.data_start + info.begin
      assert got.tobytes() == blob[start:start + info.nbytes], (where, name)
    reader.close()
    counts["read"] += 1
  print(counts)
  # the damage is varied enough to exercise both outcomes, and the stricter checks
  assert counts["read"] > 20 and counts["refused"] > CASES // 2 and counts["stricter"] > 5


def test_reader_turns_a_late_safetensors_error_into_one_line(tmp_path):
  """A file that passed the check and then changed (here: truncated) before it was read."""
  path = str(tmp_path / "late.safetensors")
  with open(path, "wb") as f:
    f.write(save({"t": np.arange(64, dtype=np.float32)}))
  reader = ShardReader()
  reader.header(path)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 4)
  try:
    reader.read(path, "t")
  except CheckpointError as e:
    assert str(e).startswith("late.safetensors: tensor t: safetensors: ") and "\n" not in str(e)
  else:
    raise AssertionError("a truncated file was read")
