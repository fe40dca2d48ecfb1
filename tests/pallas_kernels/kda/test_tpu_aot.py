"""Ahead-of-time compilation of the TPU KDA kernels for real TPU topologies, on the CPU.

Interpret mode checks the math; only Mosaic's compiler proves the kernels lower for a TPU
(docs/kernels.md). libtpu provides the compiler and the topology description; no TPU is needed. We
compile forward and gradient (bf16, T=2048, H=4, K=V=128, B=2; prepared inputs, and raw inputs
with the gate, beta sigmoid and l2norm fused in-kernel) inside a shard_map over a 2x2
mesh of the topology's chips (batch x heads), so the kernels compile as they would run sharded.
"""

import functools
import os
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# libtpu takes a machine-wide lock file meant for real chips; compiling only, several processes
# (xdist workers, other test runs) may hold it at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")
from jax.experimental import topologies

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda.reference import RawInputs
from pallas_kernels.kda.tpu import kda_tpu

B, T, H, K, V = 2, 2048, 4, 128, 128


def _mesh(topology_name):
  topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
  assert len(topo.devices) == 4, topo.devices
  return jax.sharding.Mesh(topo.devices.reshape(2, 2) if hasattr(topo.devices, "reshape")
                           else [topo.devices[:2], topo.devices[2:]], ("data", "heads"))


def _sharded_kda(mesh, fused=False):
  """fused: raw inputs (K3's gate from A_log [H] / dt_bias [H,K], beta logits, q/k l2norm)
  prepared in-kernel; A_log and dt_bias are sharded over heads only, replicated over data."""
  spec_t = P("data", None, "heads", None)
  spec_s = P("data", "heads", None, None)
  specs = (spec_t, spec_t, spec_t, spec_t, P("data", None, "heads"), spec_s)
  if fused:
    specs += (P("heads"), P("heads", None))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=specs, out_specs=(spec_t, spec_s))
  def run(q, k, v, g, beta, h0, *gate):
    opts = {}
    if fused:
      opts = dict(A_log=gate[0], dt_bias=gate[1], raw=RawInputs(
          gate="lower_bound", lower_bound=-5.0, use_qk_l2norm=True, use_beta_sigmoid=True))
    return kda_tpu(q, k, v, g, beta, initial_state=h0, output_final_state=True, **opts)

  return run, specs


def _args(mesh, specs):
  shapes = [((B, T, H, K), jnp.bfloat16), ((B, T, H, K), jnp.bfloat16),
            ((B, T, H, V), jnp.bfloat16), ((B, T, H, K), jnp.float32), ((B, T, H), jnp.float32),
            ((B, H, K, V), jnp.float32), ((H,), jnp.float32), ((H, K), jnp.float32)]
  return [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
          for (s, d), p in zip(shapes, specs)]


def _compile(fn, args):
  t0 = time.perf_counter()
  compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()
  return compiled, time.perf_counter() - t0


@pytest.mark.parametrize("fused", [False, True], ids=["prepared", "fused_raw_inputs"])
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_kda_tpu_compiles_forward_and_gradient(topology, fused):
  mesh = _mesh(topology)
  run, specs = _sharded_kda(mesh, fused)
  args = _args(mesh, specs)

  fwd, t_fwd = _compile(run, args)
  hlo = fwd.as_text()
  assert "kda_fwd_tpu" in hlo and "tpu_custom_call" in hlo

  def loss(*a):
    o, ht = run(*a)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht)

  grad, t_grad = _compile(jax.grad(loss, argnums=tuple(range(len(args)))), args)
  hlo = grad.as_text()
  assert "kda_fwd_tpu" in hlo and "kda_bwd_tpu" in hlo
  # the kernels' cost estimates reach XLA's cost analysis (what `k3jax plan` reads): per
  # device, the forward is one pass of the chunked algorithm over its (B/2, H/2) rows and
  # heads, the gradient a forward and a backward of 3 passes (recompute + 2 x gradients)
  one_pass = (B // 2) * (H // 2) * T * cm.flops_per_token(K, V)
  fwd_flops, grad_flops = (c.cost_analysis()["flops"] for c in (fwd, grad))
  assert one_pass <= fwd_flops <= 1.1 * one_pass, (fwd_flops, one_pass)
  assert 4 * one_pass <= grad_flops <= 4.4 * one_pass, (grad_flops, one_pass)
  mem = grad.memory_analysis()
  print(f"\n{topology} {'fused' if fused else 'prepared'}: forward compiled in {t_fwd:.1f}s, "
        f"gradient in {t_grad:.1f}s; gradient "
        f"memory per device: args {mem.argument_size_in_bytes / 2**20:.1f} MiB, "
        f"temp {mem.temp_size_in_bytes / 2**20:.1f} MiB, "
        f"out {mem.output_size_in_bytes / 2**20:.1f} MiB")


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_kda_step_tpu_compiles(topology):
  from pallas_kernels.kda.tpu import kda_step_tpu
  mesh = _mesh(topology)
  spec_h = P("data", "heads")
  specs = (P("data", "heads", None),) * 4 + (spec_h, P("data", "heads", None, None))
  step = jax.shard_map(kda_step_tpu, mesh=mesh, in_specs=specs, out_specs=(specs[2], specs[5]))
  bf = jnp.bfloat16
  shapes = [((8, H, K), bf), ((8, H, K), bf), ((8, H, V), bf), ((8, H, K), jnp.float32),
            ((8, H), jnp.float32), ((8, H, K, V), jnp.float32)]
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
          for (s, d), p in zip(shapes, specs)]
  compiled, t = _compile(step, args)
  assert "kda_step_tpu" in compiled.as_text()
  print(f"\n{topology}: decode step compiled in {t:.1f}s")
