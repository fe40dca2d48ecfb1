"""k3jax/plan/comm.traffic: the bytes each device sends in the collectives of a compiled program,
by kind and mesh axis, loops by their trip counts, against the per-kind formula worked by hand
from the arrays' shapes (docs/plan.md#communication), on the 8 test devices."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax import plan as plan_lib
from k3jax.plan import comm
from k3jax.plan import train as train_plan

F32 = 4
TRIPS = 5


def _program(x):
  """One of each kind over a 2 x B mesh ("a", "b"), and TRIPS all-to-alls in a loop."""
  gathered = jax.lax.all_gather(x, "b", tiled=True)
  summed = jax.lax.psum(x, "a")
  swapped = jax.lax.all_to_all(x, "b", 0, 0, tiled=True)
  scattered = jax.lax.psum_scatter(x, "b", tiled=True)
  moved = jax.lax.ppermute(x, "a", [(0, 1), (1, 0)])
  looped = jax.lax.fori_loop(
      0, TRIPS, lambda i, c: jax.lax.all_to_all(c, "b", 1, 1, tiled=True) * 0.5, x)
  return sum(y.sum() for y in (gathered, summed, swapped, scattered, moved, looped))


def _tpu_devices():
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  pytest.importorskip("libtpu", reason="libtpu compiles for TPU ahead of time")
  return plan_lib.topology_devices("v5e:2x2")


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_each_kind_counts_its_formula_bytes_on_its_axis(platform):
  """XLA:CPU on 2 x 4 test devices; XLA:TPU (ahead of time, v5e:2x2) on 2 x 2, where the
  permute is async (its start's tuple holds the operand too) and the loop's trip count is
  read from its condition."""
  devices = jax.devices()[:8] if platform == "cpu" else _tpu_devices()
  b = len(devices) // 2
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, b), ("a", "b"))
  rows, cols = 128, 256  # one device's block
  x = jax.ShapeDtypeStruct((2 * rows, b * cols), jnp.float32,
                           sharding=jax.NamedSharding(mesh, P("a", "b")))
  fn = jax.jit(jax.shard_map(_program, mesh=mesh, in_specs=P("a", "b"), out_specs=P(),
                             check_vma=False))
  with jax.set_mesh(mesh):
    text = fn.trace(x).lower(lowering_platforms=(platform,)).compile().as_text()
  items = comm.traffic(text, dict(mesh.shape))
  local = rows * cols * F32
  want_kind = {
      "all-gather": b * local * (b - 1) / b,       # its output b blocks, (n-1)/n arrives
      "all-reduce": 2 * local * (2 - 1) / 2,       # 2 B (n-1)/n over a (n = 2)
      "all-to-all": local * (b - 1) / b * (1 + TRIPS),  # once outside, TRIPS in the loop
      "reduce-scatter": local / b * (b - 1),       # output B/b: the input's (n-1)/n
      "collective-permute": local,
      "ragged-all-to-all": 0.0,
  }
  assert comm.by_kind(items) == want_kind
  assert comm.by_axis(items) == {
      "b": {"all-gather": want_kind["all-gather"], "all-to-all": want_kind["all-to-all"],
            "reduce-scatter": want_kind["reduce-scatter"]},
      "a": {"all-reduce": want_kind["all-reduce"],
            "collective-permute": want_kind["collective-permute"]}}


def test_groups_written_as_device_ids_name_their_mesh_axes():
  """Groups as explicit ids, as an iota and as permute pairs map to the axes whose coordinates
  differ within them (device id = index in the mesh, row-major)."""
  sizes = {"data": 2, "fsdp": 2, "tensor": 2}
  assert comm._group("replica_groups={{0,1},{2,3},{4,5},{6,7}}", sizes, 8) == (2, ("tensor",))
  assert comm._group("replica_groups=[2,4]<=[8]", sizes, 8) == (4, ("fsdp", "tensor"))
  assert comm._group("replica_groups=[4,2]<=[2,4]T(1,0)", sizes, 8) == (2, ("data",))
  assert comm._group("source_target_pairs={{0,2},{2,0}}", sizes, 8) == (2, ("fsdp",))
  assert comm._group("replica_groups={}", sizes, 8) == (8, ("data", "fsdp", "tensor"))
  assert comm._group("replica_groups=mesh['x'=2,'y'=4] {'x','y'}", {}, 8) == (8, ("x", "y"))
  # the plan's axes in the mesh's order; another mesh's (a shard_map's) named by the devices
  assert comm._group("replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'tensor','data'}",
                     sizes, 8) == (4, ("data", "tensor"))
  assert comm._group("replica_groups=mesh['data'=1,'fsdp'=4,'tensor'=2] {'data','fsdp'}",
                     {"data": 1, "fsdp": 4, "tensor": 2}, 8) == (4, ("fsdp",))  # size 1: no
  assert comm._group("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", sizes,
                     8) == (4, ("data", "fsdp"))
  # a sub-axis 'a':(p)k, the k-sized middle of a split [p, k, rest] (the full K3 step on
  # v5p:8x8x16 writes fsdp=128's groups of 16 so)
  pod = {"data": 1, "fsdp": 128, "expert": 1, "tensor": 8}
  assert comm._group("replica_groups=mesh['data'=1,'fsdp'=128,'expert'=1,'tensor'=8] "
                     "{'fsdp':(8)16}", pod, 1024) == (16, ("fsdp",))
  assert comm._group("replica_groups=mesh['data'=1,'fsdp'=128,'expert'=1,'tensor'=8] "
                     "{'fsdp':(8)16,'tensor'}", pod, 1024) == (128, ("fsdp", "tensor"))
  # ids differing by 4 (axis_0's middle of [2, 2, 2] x axis_1 2): fsdp's 2 apart
  assert comm._group("replica_groups=mesh['axis_0'=8,'axis_1'=2] {'axis_0':(2)2}",
                     {"data": 2, "fsdp": 4, "tensor": 2}, 16) == (2, ("fsdp",))


def test_step_bounds_and_mfu_from_the_chip_table():
  """v5p: 6 links x 100 GB/s each way; 1.2 TB sent is 2 s of communication beside 1 s of
  compute: [2, 3] s; model FLOPs of 1.5 s at the 4 devices' peak: MFU [0.5, 0.75]."""
  v5p = plan_lib.CHIPS["v5p"]
  assert v5p.ici_bandwidth == 6 * 100e9
  bounds = train_plan.step_bounds(1.0, 1.2e12, v5p)
  assert bounds == [2.0, 3.0]
  assert train_plan.mfu_range(1.5 * 4 * v5p.peak_flops, bounds, 4, v5p) == [0.5, 0.75]
  assert train_plan.step_bounds(1.0, 1.0, plan_lib.CHIPS["v4"]) is None  # no ICI figures
