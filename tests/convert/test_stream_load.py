"""Per-host streaming load (convert/stream.py): `ShardReader.read_box` reads an N-d box of a
safetensors tensor by its bytes alone, and a sharded load reads, per process, only the boxes
of its devices. Checked against safetensors' own reader (load_file) and numpy slicing."""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from convert.safetensors_io import ShardReader
from convert.stream import addressable_boxes, sharded_packed, sharded_tensor
from k3jax.errors import CheckpointError
from tests.sharding.test_multiprocess import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
# name -> partition spec on the (a=2, b=4) mesh: every tensor cut on a non-leading axis
SPECS = {"w": P(None, "a", "b"), "bf": P("b", "a"), "codes": P("b", "a", None),
         "scales": P("b", "a", None), "v": P(None, None, "a")}


def _write(path) -> dict:
  rng = np.random.default_rng(0)
  tensors = {
      "w": rng.standard_normal((3, 8, 12)),
      "bf": rng.standard_normal((8, 10)).astype(ml_dtypes.bfloat16),
      "codes": rng.integers(0, 256, (8, 6, 16), dtype=np.uint8),   # [experts, out, in/2]
      "scales": rng.integers(100, 130, (8, 6, 1), dtype=np.uint8),  # [experts, out, in/32]
      "v": rng.standard_normal((2, 3, 4)).astype(np.float32),
      "s": np.array(1.5, np.float32),
  }
  save_file(tensors, str(path))
  return tensors


def _mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def test_read_box_equals_numpy_slicing(tmp_path):
  path = tmp_path / "m.safetensors"
  _write(path)
  full = load_file(str(path))
  reader = ShardReader()
  rng = np.random.default_rng(1)
  for name, want in full.items():
    for _ in range(40):
      box = []
      for d in want.shape:
        a = int(rng.integers(0, d + 1))
        box.append(slice(a, int(rng.integers(a, d + 1))))
      before = reader.bytes_read
      got = reader.read_box(str(path), name, tuple(box))
      assert got.dtype == want.dtype
      np.testing.assert_array_equal(got, want[tuple(box)])
      assert reader.bytes_read - before == want[tuple(box)].nbytes  # the box's bytes only
  np.testing.assert_array_equal(reader.read_box(str(path), "w", (slice(1, 2),)), full["w"][1:2])


def test_sharded_load_reads_each_device_box(tmp_path, x64):
  path = tmp_path / "m.safetensors"
  full = _write(path)
  mesh = _mesh()
  reader = ShardReader()
  for name, spec in SPECS.items():
    arr = sharded_tensor(reader, str(path), name, NamedSharding(mesh, spec))
    np.testing.assert_array_equal(np.asarray(arr), full[name])
    for shard in arr.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), full[name][shard.index])
  codes, scales = sharded_packed(reader, (str(path), "codes"), (str(path), "scales"),
                                 NamedSharding(mesh, SPECS["codes"]),
                                 NamedSharding(mesh, SPECS["scales"]))
  np.testing.assert_array_equal(np.asarray(codes), full["codes"])
  np.testing.assert_array_equal(np.asarray(scales), full["scales"])
  # the devices of one half of the mesh (a = 0) hold, and read, half of every tensor
  half = set(mesh.devices[0].tolist())
  for name, spec in SPECS.items():
    reader = ShardReader()
    boxes = {tuple(s.indices(d)[:2] for s, d in zip(box, full[name].shape)): box
             for dev, box in addressable_boxes(NamedSharding(mesh, spec),
                                               full[name].shape).items() if dev in half}
    for box in boxes.values():
      reader.read_box(str(path), name, box)
    assert reader.bytes_read == full[name].nbytes // 2, name


def test_read_box_refuses_bad_boxes(tmp_path):
  path = tmp_path / "m.safetensors"
  _write(path)
  reader = ShardReader()
  for box, msg in [((slice(0, 4),), "leaves its 0:3"), ((slice(0, 3, 2),), "step 1"),
                   ((slice(None),) * 4, "4-axis box")]:
    with pytest.raises(CheckpointError, match=msg):
      reader.read_box(str(path), "w", box)
  with pytest.raises(CheckpointError, match="no tensor nope"):
    reader.read_box(str(path), "nope", ())


DRIVER = """
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors.numpy import load_file
from convert.safetensors_io import ShardReader
from convert.stream import sharded_tensor
from sharding.distributed import initialize
from tests.convert.test_stream_load import SPECS
path, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
jax.config.update("jax_enable_x64", True)  # the float64 tensor stays float64
initialize(f"localhost:{port}", 2, pid)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
reader = ShardReader()
arrays = {n: sharded_tensor(reader, path, n, NamedSharding(mesh, s)) for n, s in SPECS.items()}
read = reader.bytes_read
full = load_file(path)  # the single-process load, after counting
for n, arr in arrays.items():
  for shard in arr.addressable_shards:
    assert np.array_equal(np.asarray(shard.data), full[n][shard.index]), n
print(json.dumps({"read": read, "total": sum(full[n].nbytes for n in SPECS)}))
jax.distributed.shutdown()
"""


def test_two_processes_each_read_half(tmp_path):
  path = tmp_path / "m.safetensors"
  _write(path)
  port = free_port()
  flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
  env = {**os.environ, "XLA_FLAGS": flags + " --xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(path), str(port), str(i)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  print("bytes read per process:", [r["read"] for r in results], "of", results[0]["total"])
  for r in results:
    assert r["read"] == r["total"] // 2, results  # a = process: each holds half of each tensor
