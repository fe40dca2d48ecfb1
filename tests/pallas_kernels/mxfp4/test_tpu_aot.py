"""Ahead-of-time compilation of the MXFP4 grouped matmul's Pallas TPU kernel (pallas_kernels/
mxfp4/tpu.py) for real TPU topologies, on the CPU (libtpu's compiler; no TPU needed), as the
KDA kernels' test does: interpret mode checks the math, only Mosaic proves the kernel lowers.

Forward and input gradient (the transposed kernel), bf16, inside a shard_map over a 2x2 mesh
(rows over both axes, the experts over one: the operands' varying types differ, as in the
expert-parallel body). Per device: 512 rows, 4 experts of in 1024 x out 1536 (2 contraction
x 3 output tiles forward). The compiled program holds the packed weights and no float copy
of them: its temporaries stay far below the local experts' bf16 bytes.
"""

import os
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# libtpu takes a machine-wide lock file meant for real chips; compiling only, several processes
# may hold it at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")
from jax.experimental import topologies

from pallas_kernels.mxfp4.ops import grouped_matmul_mxfp4

E, K, N, M = 8, 1024, 1536, 2048  # global: 4 devices x 512 rows, 2 x 4 experts


def _mesh(topology_name):
  topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
  assert len(topo.devices) == 4, topo.devices
  devices = topo.devices.reshape(2, 2) if hasattr(topo.devices, "reshape") else [
      topo.devices[:2], topo.devices[2:]]
  return jax.sharding.Mesh(devices, ("expert", "data"))


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_mxfp4_grouped_matmul_compiles_forward_and_gradient(topology):
  mesh = _mesh(topology)
  rows, experts = P(("expert", "data")), P("expert")
  specs = (rows, experts, experts, experts)

  def run(x, codes, scales, sizes):
    return jax.shard_map(
        lambda *a: grouped_matmul_mxfp4(*a, impl="pallas"), mesh=mesh, in_specs=specs,
        out_specs=rows)(x, codes, scales, sizes)

  shapes = [((M, K), jnp.bfloat16), ((E, N, K // 2), jnp.uint8), ((E, N, K // 32), jnp.uint8),
            ((E,), jnp.int32)]
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
          for (s, d), p in zip(shapes, specs)]

  def compile_(fn):
    t0 = time.perf_counter()
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile(), (
        time.perf_counter() - t0)

  fwd, t_fwd = compile_(run)
  assert "mxfp4_grouped_matmul" in fwd.as_text() and "tpu_custom_call" in fwd.as_text()

  def loss(x, codes, scales, sizes):
    return jnp.sum(run(x, codes, scales, sizes).astype(jnp.float32) ** 2)

  grad, t_grad = compile_(jax.grad(loss))
  assert "mxfp4_grouped_matmul_t" in grad.as_text()
  # the kernels' cost estimates reach XLA's cost analysis (what `k3jax plan` reads): per
  # device, 2 m K N each way, counted at every row of the buffer
  per_device = 2 * (M // 4) * K * N
  fwd_flops, grad_flops = (c.cost_analysis()["flops"] for c in (fwd, grad))
  assert per_device <= fwd_flops <= 1.1 * per_device, (fwd_flops, per_device)
  assert 2 * per_device <= grad_flops <= 2.2 * per_device, (grad_flops, per_device)
  mem = grad.memory_analysis()
  dense_local = (E // 2) * K * N * 2  # the local experts in bf16
  assert mem.temp_size_in_bytes < dense_local / 4, (mem.temp_size_in_bytes, dense_local)
  print(f"\n{topology}: forward compiled in {t_fwd:.1f}s, gradient in {t_grad:.1f}s; gradient "
        f"memory per device: args {mem.argument_size_in_bytes / 2**20:.1f} MiB, temp "
        f"{mem.temp_size_in_bytes / 2**20:.1f} MiB (local experts in bf16: "
        f"{dense_local / 2**20:.1f} MiB)")
