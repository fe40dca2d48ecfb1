"""The safetensors header check and the streaming writer, against safetensors itself."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save

from convert.safetensors_io import ShardWriter, encode_header, read_header
from k3jax.errors import CheckpointError


def _tensors(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "b.weight": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
      "a.bias": rng.standard_normal(7).astype(np.float32),
      "z.codes": rng.integers(0, 255, (4, 2), dtype=np.uint8),
      "m.half": rng.standard_normal((2, 2)).astype(np.float16),
      "c.double": rng.standard_normal(3),
      "e.empty": np.zeros((0, 4), np.float32),
  }


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_writer_reproduces_safetensors_byte_for_byte(tmp_path, metadata):
  tensors = _tensors()
  want = save(tensors, metadata=metadata)
  header = encode_header([(k, {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32",
                             np.dtype(np.uint8): "U8", np.dtype(np.float16): "F16",
                             np.dtype(np.float64): "F64"}[v.dtype], v.shape)
                        for k, v in tensors.items()], metadata)
  path = tmp_path / "x.safetensors"
  writer = ShardWriter(str(path), header)
  for name in reversed(list(tensors)):  # any order: each tensor goes to its offset in the header
    writer.write(name, tensors[name])
  writer.close()
  assert path.read_bytes() == want
  got = load_file(str(path))
  for k, v in tensors.items():
    np.testing.assert_array_equal(got[k], v)


def test_read_header_accepts_safetensors_files(tmp_path):
  path = tmp_path / "ok.safetensors"
  path.write_bytes(save(_tensors(), metadata={"format": "pt"}))
  h = read_header(str(path))
  assert h.metadata == {"format": "pt"} and h.tensors["b.weight"].shape == (3, 5)
  assert h.tensors["b.weight"].dtype == "BF16"


def _file(tmp_path, header: bytes, data: bytes = b"", length: int | None = None):
  path = tmp_path / "bad.safetensors"
  n = len(header) if length is None else length
  path.write_bytes(struct.pack("<Q", n) + header + data)
  return str(path)


@pytest.mark.parametrize("header,data,length,message", [
    (b"", b"", 2**40, "exceeds"),
    (b"{}", b"", 100, "runs past the end"),
    (b"{not json", b"", None, "not JSON"),
    (b"[1, 2]", b"", None, "not a JSON object"),
    (json.dumps({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(),
     b"\0" * 4, None, "truncated"),
    (json.dumps({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(),
     b"\0" * 4, None, "needs 8"),
    (json.dumps({"t": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}).encode(),
     b"\0", None, "unsupported dtype"),
    (json.dumps({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}).encode(),
     b"\0", None, "non-negative"),
    (json.dumps({"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                 "u": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}).encode(),
     b"\0" * 3, None, "overlap"),
    (json.dumps({"__metadata__": {"a": 1}}).encode(), b"", None, "__metadata__"),
])
def test_read_header_refuses(tmp_path, header, data, length, message):
  path = _file(tmp_path, header, data, length)
  with pytest.raises(CheckpointError, match=message) as e:
    read_header(path)
  assert "bad.safetensors" in str(e.value)


def test_read_header_refuses_short_file(tmp_path):
  path = tmp_path / "tiny.safetensors"
  path.write_bytes(b"\1\2")
  with pytest.raises(CheckpointError, match="tiny.safetensors: not a safetensors"):
    read_header(str(path))


def test_reader_reads_big_tensors_in_blocks(tmp_path):
  """Tensors above the reader's mapping budget come in row blocks, reopening the file between
  them: the same values as one safetensors read."""
  from convert.safetensors_io import ShardReader
  tensors = _tensors(3)
  path = str(tmp_path / "x.safetensors")
  with open(path, "wb") as f:
    f.write(save(tensors))
  reader = ShardReader(recycle_bytes=16)
  for name, value in tensors.items():
    got = reader.read(path, name)
    assert got.dtype == value.dtype and got.shape == value.shape
    np.testing.assert_array_equal(got, value)
  np.testing.assert_array_equal(reader.read(path, "b.weight", slice(1, 3)),
                                tensors["b.weight"][1:3])
  reader.close()
