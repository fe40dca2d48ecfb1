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
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from convert.hf_load import load_model
from convert.load import load_any, named_shardings
from convert.safetensors_io import ShardReader
from convert.source import items_to_read, open_source
from convert.stream import addressable_boxes, load_folder_sharded, sharded_packed, sharded_tensor
from k3jax.errors import CheckpointError
from k3jax.execution import Execution
from sharding.rules import MESH_AXES
from tests.sharding.test_multiprocess import free_port

F64 = Execution(dtype="float64", param_dtype="float64")
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
path, port, pid, folder = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
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
# the tiny K3 (MXFP4 experts) on the rules table's shardings: fsdp=2 runs across the processes
from flax import nnx
from convert.hf_load import load_model
from convert.load import named_shardings
from convert.source import items_to_read, open_source
from convert.stream import load_folder_sharded
from sharding.rules import MESH_AXES
from tests.convert.test_stream_load import F64
source = open_source(folder)
shardings = named_shardings(source.cfg, jax.make_mesh((1, 2, 2, 1, 2), MESH_AXES))
got = load_folder_sharded(source, source.cfg, F64, shardings)
model_read = source.reader.bytes_read
want = {tuple(map(str, p)): v.get_value()
        for p, v in nnx.to_flat_state(nnx.state(load_model(folder, F64)[0]))}
for path, array in got.items():
  for shard in array.addressable_shards:
    assert np.array_equal(np.asarray(shard.data), np.asarray(want[path])[shard.index]), path
total = sum(p.info.nbytes for it in items_to_read(source)
            for p in it.parts)
print(json.dumps({"read": read, "total": sum(full[n].nbytes for n in SPECS),
                  "model_read": model_read, "model_total": total}))
jax.distributed.shutdown()
"""


def test_two_processes_each_read_half(tmp_path, reference_dir):
  path = tmp_path / "m.safetensors"
  _write(path)
  port = free_port()
  flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
  env = {**os.environ, "XLA_FLAGS": flags + " --xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(path), str(port), str(i),
                             os.path.join(reference_dir, "k3_tiny_a")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  print("bytes read per process:", [(r["read"], r["model_read"]) for r in results], "of",
        (results[0]["total"], results[0]["model_total"]))
  for r in results:
    assert r["read"] == r["total"] // 2, results  # a = process: each holds half of each tensor
    # the model: the fsdp-split arrays half each, the replicated ones (norms, biases) whole
    assert r["model_read"] < 0.6 * r["model_total"], results


def test_model_from_folder_box_by_box_equals_the_in_memory_load(reference_dir, x64):
  """k3_tiny_a (MXFP4 experts as released) on a (fsdp 2, expert 2, tensor 2) mesh: every
  device block read box by box equals that block of `load_model`'s whole-tensor load."""
  folder = os.path.join(reference_dir, "k3_tiny_a")
  source = open_source(folder)
  mesh = jax.make_mesh((1, 2, 2, 1, 2), MESH_AXES)
  shardings = named_shardings(source.cfg, mesh)
  got = load_folder_sharded(source, source.cfg, F64, shardings)
  model, _ = load_model(folder, F64)
  want = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
  assert set(got) == set(want)
  split = 0
  for path, array in got.items():
    assert array.sharding == shardings[path] and array.dtype == want[path].dtype
    for shard in array.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want[path])[shard.index])
    split += len({str(s.index) for s in array.addressable_shards}) > 1
  assert split > 0  # some arrays are cut into blocks, not all replicated
  # load_any(mesh=...) on a folder goes this way: the model holds these very arrays
  placed, _ = load_any(folder, F64, mesh=mesh)
  for p, v in nnx.to_flat_state(nnx.state(placed)):
    path = tuple(map(str, p))
    assert v.get_value().sharding == shardings[path]
    np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(want[path]))
  # kept packed: the released codes and scales, block by block, byte for byte (safetensors'
  # own reader; repacking the dequantised values may encode a row differently)
  packed = load_any(folder, F64, mesh=mesh, keep_packed=True)[0]
  packed = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(packed))}
  shardings = named_shardings(source.cfg, mesh, keep_packed=True)
  expect = {}  # the stacked codes and scales as released
  for item in items_to_read(source):
    for part, suffix in zip(item.parts if item.mxfp4 else (), ("_packed", "_scale")):
      path = (*item.slot.entry.paths[0][:-1], item.slot.entry.paths[0][-1] + suffix)
      stack = expect.setdefault(path, np.zeros(packed[path].shape, np.uint8))
      stack[item.slot.index] = load_file(part.path)[part.info.name]
  assert expect and set(expect) <= set(packed)
  for path, want_codes in expect.items():
    assert packed[path].sharding == shardings[path], path
    for shard in packed[path].addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), want_codes[shard.index])


def test_block_coordinates_never_materialise_a_tensor(reference_dir):
  """The memory bound of the streaming load: every entry's transform of the zero-stride
  coordinate views stays a view (only a block's coordinates are ever copied); A_log alone
  refuses them (it checks its padding) and is read whole, a vector."""
  source = open_source(os.path.join(reference_dir, "k3_tiny_a"))
  seen, copies = set(), []
  for item in items_to_read(source):
    entry = item.slot.entry
    if entry.hf in seen:
      continue
    seen.add(entry.hf)
    info = item.parts[0].info
    hf = info.shape if not item.mxfp4 else (info.shape[0], info.shape[1] * 2)
    for axis, dim in enumerate(hf):
      along = np.arange(dim).reshape([dim if j == axis else 1 for j in range(len(hf))])
      try:
        outs = entry.to_k3jax(np.broadcast_to(along, hf), source.cfg)
      except ValueError:
        copies.append(entry.hf)
        break
      copies += [entry.hf for o in outs if not np.shares_memory(o, along)]
  assert copies == ["layers.{i}.self_attn.A_log"] and len(seen) > 40
