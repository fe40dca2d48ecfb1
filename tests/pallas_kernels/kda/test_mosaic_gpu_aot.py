"""Deviceless ahead-of-time compilation of the Mosaic GPU KDA kernel for an H100 (opt-in).

As test_gpu_aot.py for the Triton kernels: with the CUDA PJRT plugin installed
(`pip install jax-cuda12-plugin==<jax version>`), XLA compiles for a compile-only H100 topology
on a machine without a GPU, which runs Mosaic GPU's pipeline down to a cubin (register and
shared-memory fit: the kernel plans 208.5 KiB of the 227 KiB at K = V = 128). Opt-in
(K3JAX_GPU_AOT=1); the CUDA lowering alone is checked in CI (test_mosaic_gpu.py).
"""

import os
import time

import jax
import jax.numpy as jnp
import pytest

if os.environ.get("K3JAX_GPU_AOT") != "1":
  pytest.skip("opt-in: set K3JAX_GPU_AOT=1", allow_module_level=True)
pytest.importorskip("jax_cuda12_plugin", reason="needs jax-cuda12-plugin for a CUDA compiler")
from jax.experimental import topologies  # noqa: E402

from pallas_kernels.kda.mosaic_gpu import kda_mosaic_gpu  # noqa: E402
from tests.pallas_kernels.kda.test_gpu_aot import H100  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("what", ["forward", "gradient"])
def test_kda_mosaic_gpu_compiles_for_h100(what):
  topo = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x1")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  B, T, H, K = 1, 256, 2, 128
  bf, f32 = jnp.bfloat16, jnp.float32
  args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in
          [((B, T, H, K), bf)] * 3 + [((B, T, H, K), f32), ((B, T, H), f32),
                                      ((B, H, K, K), f32)]]

  def fwd(q, k, v, g, beta, h0):
    return kda_mosaic_gpu(q, k, v, g, beta, initial_state=h0, output_final_state=True)

  def loss(*a):
    o, ht = fwd(*a)
    return jnp.sum(o.astype(f32) ** 2) + jnp.sum(ht)

  fn = fwd if what == "forward" else jax.grad(loss, argnums=range(6))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
  print(f"\nH100 {what}: compiled in {time.perf_counter() - t0:.0f}s; "
        f"{compiled.memory_analysis()}")
