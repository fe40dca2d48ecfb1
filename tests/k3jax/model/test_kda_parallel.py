"""KDA per shard on a mesh (k3jax/model/kda_parallel.py): rows over data x expert, heads over
tensor, on 8 fake CPU devices, against the naive recurrence in float64 (docs/kernels.md,
docs/correctness.md; tolerances in tests/numerics.py): outputs, final state and the gradients w.r.t.
every raw input, A_log and dt_bias included (each device holds a share of the rows, so those are
summed over the mesh). The Pallas TPU kernel runs in interpret mode: inside the shard_map it sees
its local [B/4, T, H/2, K] blocks, which is what lets it lower in a sharded TPU step."""

import functools

import jax
import pytest

from k3jax.model import kda_parallel
from pallas_kernels.kda import ops
from sharding.mesh import make_mesh
from tests.pallas_kernels.kda import kda_cases

MESH = "data=2,expert=2,tensor=2"


def on_mesh(parallel_fn, op):
  """The op as the model calls it, jitted; the caller holds the context mesh."""
  def run(*args, **kw):
    return jax.jit(functools.partial(parallel_fn, op, **kw))(*args)
  return run


@pytest.fixture(autouse=True)
def mesh():
  with jax.set_mesh(make_mesh(MESH, jax.devices()[:8])):
    yield


@pytest.mark.parametrize("backend", ["xla_cpu", "chunked", "pallas_tpu"])
def test_sharded_kda_matches_naive(backend):
  op = functools.partial(ops.kda, backend=backend, interpret=backend.startswith("pallas"))
  # B=4 rows split 4 ways, H=2 heads split 2 ways; two segments, a given initial state
  kda_cases.check_fused_against_naive(on_mesh(kda_parallel.kda, op), B=4, T=130, H=2, K=32,
                                      V=64)


def test_sharded_decode_step_matches_naive():
  """B=2 rows on 4 batch devices and H=3 heads on tensor=2 split only as far as they divide
  (rows over data, heads whole)."""
  op = functools.partial(ops.kda_step, backend="pallas_tpu", interpret=True)
  kda_cases.check_decode_steps(on_mesh(kda_parallel.kda_step, op))


def test_sharded_forward_runs_local_blocks_with_no_collective():
  """The compiled forward on operands placed as the model's activations are: every device runs
  the chunked op on its [1, T, 1, K] block and nothing moves between devices."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from k3jax.plan import hlo
  raw = kda_cases.make_raw_inputs(4, 130, 2, 32, 64)
  mesh = jax.sharding.get_abstract_mesh()
  rows = ("data", "expert")
  specs = [P(rows, None, "tensor", None)] * 4 + [P(rows, None, "tensor"), P("tensor"),
                                                 P("tensor", None), P(rows, "tensor")]
  q, k, v, x, logits, A_log, dt_bias, h0 = (
      jax.device_put(a, NamedSharding(make_mesh(MESH, jax.devices()[:8]), s))
      for a, s in zip(raw, specs))
  assert not mesh.empty
  op = functools.partial(ops.kda, backend="xla_cpu", raw=kda_cases.K3_RAW,
                         output_final_state=True)
  fn = jax.jit(functools.partial(kda_parallel.kda, op))
  compiled = fn.lower(q, k, v, x, logits, A_log=A_log, dt_bias=dt_bias,
                      initial_state=h0).compile()
  text = compiled.as_text()
  layout = text.split("entry_computation_layout={(")[1].split(")->")[0]
  assert layout.startswith("f32[1,130,1,32]") and "f32[4,130,2,32]" not in text
  assert hlo.collectives(text) == []
