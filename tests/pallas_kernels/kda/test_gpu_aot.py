"""Deviceless ahead-of-time compilation of the GPU KDA kernels (Triton and Mosaic GPU) for an
H100.

XLA can compile for a CUDA target on a machine without a GPU when the CUDA PJRT plugin is
installed (`jax-cuda12-plugin` and `jax-cuda12-pjrt` at jax's version, in the `test` extra; no
`with-cuda` extra and no CUDA libraries needed): a compile-only topology from a target config
describing the GPU. This runs Triton's whole pipeline (Triton IR -> PTX -> cubin), so it proves
what interpret mode and lowering (test_gpu.py, test_mosaic_gpu.py) cannot: that the kernels fit
the GPU (shared memory, registers; the Mosaic GPU kernel plans 208.5 KiB of the 227 KiB at
K = V = 128). CI runs it: without the plugin these tests fail rather than skip, so a test
environment that lost the plugin cannot pass unnoticed. The rest of the suite stays on the CPU
backend (JAX_PLATFORMS=cpu, tests/conftest.py); a compile-only topology needs no CUDA backend.
"""

import importlib.util
import time

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies

from pallas_kernels.kda.gpu import kda_gpu, kda_step_gpu
from pallas_kernels.kda.mosaic_gpu import kda_mosaic_gpu
from tests.pallas_kernels.kda import kda_cases

H100 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@pytest.fixture(autouse=True)
def cuda_compiler():
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    pytest.fail("no CUDA compiler: jax-cuda12-plugin is missing; install the test extra "
                "(pip install -e '.[test]')", pytrace=False)


# The Triton backward is the longest compile of the suite (minutes): `long`; Mosaic GPU (the
# backend sm_90+ GPUs run) compiles both ways in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("kernel,what", [
    (kda_gpu, "forward"), pytest.param(kda_gpu, "gradient", marks=pytest.mark.long),
    (kda_mosaic_gpu, "forward"), (kda_mosaic_gpu, "gradient")],
    ids=["triton-forward", "triton-gradient", "mosaic_gpu-forward", "mosaic_gpu-gradient"])
def test_kda_gpu_compiles_for_h100(kernel, what):
  topo = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x1")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  fn = kda_cases.forward_and_gradient(kernel)[what]
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # Pallas reads the GPU kind here
    t0 = time.perf_counter()
    compiled = jax.jit(fn).trace(*kda_cases.cuda_inputs(sh)).lower(
        lowering_platforms=("cuda",)).compile()
  print(f"\nH100 {kernel.__name__} {what}: compiled in {time.perf_counter() - t0:.0f}s; "
        f"{compiled.memory_analysis()}")


@pytest.mark.slow
def test_kda_step_gpu_compiles_for_h100():
  topo = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x1")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  B, H, K = 8, 4, 128
  bf, f32 = jnp.bfloat16, jnp.float32
  args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in
          [((B, H, K), bf)] * 3 + [((B, H, K), f32), ((B, H), f32), ((B, H, K, K), f32)]]
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    jax.jit(kda_step_gpu).trace(*args).lower(lowering_platforms=("cuda",)).compile()
