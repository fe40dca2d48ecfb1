"""Context parallelism (k3jax/model/context_parallel.py, docs/sharding.md#context-parallelism):
one sequence's positions split over the `context` mesh axis give the one-device model.

- A range's affine map (pallas_kernels.kda.ops.kda_range) composed with the state entering it
  gives the op over the whole sequence (float64, no mesh).
- The KDA op per shard with the positions split (k3jax/model/kda_parallel.py), both ways of
  composing the maps, on raw inputs with segments restarting mid-range and on a range's first
  position: the float64 recurrence's outputs, final state and every gradient. The Pallas TPU
  kernel (interpret mode) runs its ranges' V + K value columns inside the shard_map (float32,
  the kernels' tolerance).
- The whole model (KDA with its short convolutions, MLA over the gathered latents, the MoE,
  AttnRes) on `data=2,context=4` and `context=2,expert=2,tensor=2` on 8 CPU devices: the
  one-device logits and the gradient of every parameter, float64, to 1e-9, on packed rows
  whose documents cross device boundaries and start mid-range; the compiled program moves no
  whole sequence of activations but the MLA latents it gathers.
- A context size that leaves a device part of a KDA chunk, and a backend that cannot run a
  range's transition, are refused in one line before anything compiles.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.errors import ConfigError
from k3jax.execution import Execution
from k3jax.model import context_parallel, kda_parallel
from k3jax.model.transformer import K3Model
from k3jax.plan import hlo
from pallas_kernels.kda import ops
from pallas_kernels.kda.reference import naive_kda
from sharding.mesh import make_mesh
from sharding.placement import place_model
from tests.k3jax.model.helpers import F64, randomize
from tests.k3jax.train.helpers import MICRO
from tests.pallas_kernels.kda import kda_cases

# float64 sums of a few hundred O(1) terms in another order: ~1e-14 of the scale (measured
# 2e-14 on the model's gradients); a misplaced state, halo or mask moves numbers by 1e-2+
TOL = 1e-9
T = 256  # 4 devices x 64: one KDA chunk each on context=4


def packed_rows(b: int, t: int) -> np.ndarray:
  """Row 0: documents start at 100 and 130 (inside ranges of 64: one crosses a device edge)
  and 200; row 1: one starts exactly on a device edge (128) and padding ends it; the rest one
  document each."""
  seg = np.ones((b, t), np.int32)
  seg[0, 100:], seg[0, 130:], seg[0, 200:] = 2, 3, 4
  seg[1, t // 2:], seg[1, t - 6:] = 2, 0
  return seg


def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-300))


def test_range_maps_compose_to_the_whole_sequence(x64):
  """Two ranges: the second's outputs o + S^T read and final state M S + C, with S the first
  range's final state, are the recurrence over both (a restart on the second range's first
  position in row 1, inside it in row 0)."""
  q, k, v, g, beta, h0 = kda_cases.make_inputs(2, 256, 2, 16, 24, dtype=jnp.float64)
  seg = jnp.asarray(packed_rows(2, 256))
  o_ref, s_ref = naive_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                           segment_ids=seg)
  half = lambda x, i: x[:, 128 * i:128 * (i + 1)]
  o1, s1 = naive_kda(*(half(x, 0) for x in (q, k, v, g, beta)), initial_state=h0,
                     output_final_state=True, segment_ids=half(seg, 0))
  r = ops.kda_range(*(half(x, 1) for x in (q, k, v, g, beta)), segment_ids=half(seg, 1),
                    backend="chunked")
  s_in = jnp.where((seg[:, 128] != seg[:, 127])[:, None, None, None], 0.0, s1)
  o2 = r.o + jnp.einsum("bthk,bhkv->bthv", r.read, s_in)
  s2 = jnp.einsum("bhij,bhjv->bhiv", r.transition, s_in) + r.offset
  assert rel_err(jnp.concatenate([o1, o2], 1), o_ref) < TOL
  assert rel_err(s2, s_ref) < TOL


def _sharded_kda(spec, backend, composition, args, seg, dtype):
  interpret = backend.startswith("pallas")
  op = functools.partial(ops.kda, backend=backend, interpret=interpret)
  range_op = functools.partial(ops.kda_range, backend=backend, interpret=interpret)
  cot = jnp.sin(jnp.arange(2 * T * 2 * 32, dtype=dtype)).reshape(2, T, 2, 32)

  def loss(q, k, v, x, logits, A_log, dt_bias, h0):
    o, s = kda_parallel.kda(op, q, k, v, x, logits, A_log=A_log, dt_bias=dt_bias,
                            raw=kda_cases.K3_RAW, initial_state=h0, output_final_state=True,
                            segment_ids=seg, range_op=range_op, composition=composition)
    return jnp.sum(o * cot) + jnp.sum(s * s), (o, s)

  run = jax.jit(jax.grad(loss, argnums=tuple(range(8)), has_aux=True))
  if spec is None:
    return run(*args)
  with jax.set_mesh(make_mesh(spec)):
    return run(*args)


@pytest.mark.parametrize("spec,composition", [
    ("data=2,context=4", context_parallel.Composition.SEQUENTIAL),
    ("data=2,context=4", context_parallel.Composition.TREE),
    ("context=2,expert=2,tensor=2", None)])
def test_kda_split_over_context_equals_the_recurrence(x64, spec, composition):
  args = tuple(a.astype(jnp.float64) for a in kda_cases.make_raw_inputs(2, T, 2, 16, 32))
  seg = jnp.asarray(packed_rows(2, T))
  want = _sharded_kda(None, "naive", composition, args, seg, jnp.float64)
  got = _sharded_kda(spec, "xla_cpu", composition, args, seg, jnp.float64)
  for name, a, b in zip(("o", "final state", *kda_cases.RAW_NAMES),
                        (*got[1], *got[0]), (*want[1], *want[0])):
    assert float(np.max(np.abs(np.asarray(b)))) > 1e-3, name
    assert rel_err(a, b) < TOL, name


def test_pallas_tpu_ranges_inside_the_shard_map():
  """The TPU kernel on each device's range with V + K value columns (interpret mode), against
  the float64 recurrence over the whole sequence: the kernels' float32 tolerance."""
  run = lambda *a, **kw: _sharded_kda("data=2,context=4", "pallas_tpu", None, a, kw["seg"],
                                      jnp.float32)
  args = kda_cases.make_raw_inputs(2, T, 2, 16, 32)
  seg = jnp.asarray(packed_rows(2, T))
  got = run(*args, seg=seg)
  with jax.enable_x64(True):
    args64 = tuple(jnp.asarray(np.asarray(a, np.float64)) for a in args)
    want = _sharded_kda(None, "naive", None, args64, seg, jnp.float64)
  for name, a, b in zip(("o", "final state"), got[1], want[1]):
    tol = 1e-5 * max(1.0, float(np.max(np.abs(np.asarray(b)))))
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=tol, err_msg=name)
  for name, a, b in zip(kda_cases.RAW_NAMES, got[0], want[0]):
    if name in ("dA_log", "ddt_bias"):  # sums over every token: checked in float64 above
      continue
    tol = 1e-5 * max(1.0, float(np.max(np.abs(np.asarray(b)))))
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=tol, err_msg=name)


# the model: KDA (layer 0, dense MLP) and MLA (layer 1, LatentMoE); a vocabulary of 160 and 3
# experts per token (384 routed pairs per device) so that T = 256 names only the sequence axis
# among the compiled program's shapes
CFG = MICRO.replace(num_layers=2, mla_layers=(1,), latent_size=24, moe_intermediate_size=22,
                    vocab_size=160, num_experts_per_token=3)


def _model(mesh=None, ex=F64):
  model = randomize(K3Model(CFG, ex, rngs=nnx.Rngs(0)))
  if mesh is not None:
    place_model(model, mesh)
  return nnx.split(model, nnx.Param, ...)


def _loss_grad(graphdef, rest, ids, seg, cot):
  def loss(params):
    out = nnx.merge(graphdef, params, rest)(ids, segment_ids=seg)
    return jnp.sum(out.logits * cot) + jnp.sum(out.mla_max_logits), out.logits
  return jax.jit(jax.grad(loss, has_aux=True))


@pytest.fixture(scope="module")
def one_device():
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, T)))
    seg = jnp.asarray(packed_rows(2, T))
    cot = jnp.asarray(rng.standard_normal((2, T, CFG.vocab_size)))
    graphdef, params, rest = _model()
    grads, logits = _loss_grad(graphdef, rest, ids, seg, cot)(params)
    yield (ids, seg, cot), (jax.tree.map(np.asarray, grads), np.asarray(logits))


def _gathers_of_whole_sequences(text: str, t: int) -> list[str]:
  """The all-gathers and all-reduces whose result holds a whole sequence (a dimension of t
  positions: what a partitioner gathering a split axis would make). (The MoE's all-to-all
  buffers are rows of routed pairs, whatever their count.)"""
  return [c.result for c in hlo.collectives(text) if c.op in ("all-gather", "all-reduce")
          and any(str(t) in dims.split(",") for _, dims in hlo._ARRAY.findall(c.result))]


# save-attention: the latent kernel's output kept through remat (the backward from it)
@pytest.mark.parametrize("spec,remat", [("data=2,context=4", "none"),
                                        ("context=2,expert=2,tensor=2", "none"),
                                        ("data=2,context=4", "save-attention")])
def test_model_split_over_context_equals_one_device(x64, one_device, spec, remat):
  (ids, seg, cot), (want_grads, want_logits) = one_device
  mesh = make_mesh(spec)
  ex = F64.replace(remat=remat, attention="flash") if remat != "none" else F64
  with jax.set_mesh(mesh):
    graphdef, params, rest = _model(mesh, ex)
    fn = _loss_grad(graphdef, rest, ids, seg, cot)
    compiled = fn.lower(params).compile()
    grads, logits = compiled(params)
  assert rel_err(logits, want_logits) < TOL
  flat = jax.tree_util.tree_flatten_with_path(want_grads)[0]
  assert len(flat) == len(jax.tree.leaves(grads)) > 40
  for (path, want), got in zip(flat, jax.tree.leaves(grads)):
    assert rel_err(got, want) < TOL, jax.tree_util.keystr(path)
  # no collective holds a whole sequence but MLA's gather of its latents (c [kv_lora 16],
  # k_rot [rope 8]) and their segment ids
  whole = _gathers_of_whole_sequences(compiled.as_text(), T)
  b = 2 // mesh.shape["expert"] // mesh.shape["data"]
  allowed = {f"f64[{b},{T},16]", f"f64[{b},{T},8]", f"s32[{b},{T}]"}
  assert whole and {r.split("{")[0] for r in whole} <= allowed, whole


def test_bad_context_refused_before_compiling(x64):
  graphdef, params, rest = _model()
  model = nnx.merge(graphdef, params, rest)
  ids = jnp.zeros((2, 192), jnp.int32)
  with jax.set_mesh(make_mesh("data=2,context=4")):
    with pytest.raises(ConfigError, match=r"context=4 does not split a sequence of 192 "
                                          r"positions into whole KDA chunks of 64.*256"):
      model(ids)
  model = K3Model(CFG, Execution(kda_backend="pallas_gpu"), rngs=nnx.Rngs(0))
  with jax.set_mesh(make_mesh("data=2,context=4")):
    with pytest.raises(ConfigError, match="context=4 needs a KDA backend .* 'pallas_gpu'"):
      model(jnp.zeros((2, 256), jnp.int32))
