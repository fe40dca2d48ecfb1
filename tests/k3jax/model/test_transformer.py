"""The whole model on tiny configs: causal (shown with gradients), deterministic, packed
sequences independent, scanned == unrolled, remat == plain, schedule and stacks correct.

The equalities (packed == alone, scanned == unrolled, remat == plain) run in float64: the two
sides are the same math in a different summation order (other sequence lengths, a scan body
instead of unrolled layers, recomputed activations), which in float64 (u = 2^-53) moves the
logits (|logits| < 10 here) by ~1e-14 whatever the machine; TOL64 = 1e-10 leaves 10^4 of
margin, and a real difference (a token leaking across segments, a layer's weights swapped)
moves them by >= 1e-3. In float32 the same comparisons would set one rounding noise against
another at a fixed tolerance, and a router near-tie could pick another expert on another CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.execution import Execution
from k3jax.model import schedule
from k3jax.model.transformer import K3Model
from k3jax.plan import hlo
from tests.k3jax.model.helpers import F64, kimi_linear_cfg, randomize, tiny_cfg

# 5 layers [KDA+dense, KDA, KDA, MLA, MLA], AttnRes blocks of 3: every part, small compiles
SMALL = dict(num_layers=5, mla_layers=(3, 4))


TOL64 = 1e-10


@pytest.fixture(scope="module")
def model():
  return randomize(K3Model(tiny_cfg(**SMALL), rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def model64():
  with jax.enable_x64(True):
    return randomize(K3Model(tiny_cfg(**SMALL), F64, rngs=nnx.Rngs(0)))


@nnx.jit
def logits_fn(m, ids, seg):
  return m(ids, segment_ids=seg).logits


def _ids(cfg, shape, seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size)


def test_causal_by_gradient(model):
  """d logits[:, t] / d inputs_embeds[:, s] is exactly zero for every s > t, and not for s <= t."""
  emb = model.embed[...][_ids(model.cfg, (1, 12))]
  t = 5

  @nnx.jit
  def grad_fn(m, e):
    return jax.grad(lambda e: m(inputs_embeds=e).logits[:, t].sum())(e)

  g = np.asarray(grad_fn(model, emb))
  assert np.all(g[:, t + 1:] == 0)
  assert np.all(np.abs(g[:, : t + 1]).sum(-1) > 0)


def test_deterministic_and_packed_sequences_do_not_interact(model64, x64):
  """Same inputs give bit-identical logits; two sequences packed in one row (segment ids 1, 2)
  give the logits each gets alone (alone = followed by a padding segment of id 0)."""
  model = model64
  cfg = model.cfg
  a, b = _ids(cfg, (1, 7), 2), _ids(cfg, (1, 9), 3)
  packed_ids = jnp.concatenate([a, b], 1)
  packed = np.asarray(logits_fn(model, packed_ids, jnp.asarray([[1] * 7 + [2] * 9])))
  np.testing.assert_array_equal(
      packed, np.asarray(logits_fn(model, packed_ids, jnp.asarray([[1] * 7 + [2] * 9]))))
  pad = lambda x: jnp.concatenate([x, jnp.zeros((1, 16 - x.shape[1]), x.dtype)], 1)
  alone_a = logits_fn(model, pad(a), jnp.asarray([[1] * 7 + [0] * 9]))
  alone_b = logits_fn(model, pad(b), jnp.asarray([[1] * 9 + [0] * 7]))
  np.testing.assert_allclose(packed[:, :7], np.asarray(alone_a[:, :7]), atol=TOL64, rtol=0)
  np.testing.assert_allclose(packed[:, 7:], np.asarray(alone_b[:, :9]), atol=TOL64, rtol=0)
  # the segment ids matter: b after a in one sequence is another computation
  one_seq = np.asarray(logits_fn(model, packed_ids, jnp.ones((1, 16), jnp.int32)))
  assert np.abs(one_seq[:, 7:] - packed[:, 7:]).max() > 1e-3


@pytest.mark.parametrize("make", [lambda **kw: tiny_cfg(num_layers=6, mla_layers=(5,), **kw),
                                  kimi_linear_cfg])
def test_scanned_equals_unrolled(make, x64):
  cfg = make()
  runs = schedule.runs(cfg, scan=True)
  assert any(r.scanned for r in runs)
  m = randomize(K3Model(cfg, F64, rngs=nnx.Rngs(1)))
  ids = _ids(cfg, (2, 9), 4)
  fwd = nnx.jit(lambda m, ids: m(ids))
  scanned = fwd(m, ids)
  m.ex = F64.replace(scan_layers=False)
  unrolled = fwd(m, ids)
  np.testing.assert_allclose(np.asarray(scanned.logits), np.asarray(unrolled.logits),
                             atol=TOL64, rtol=0)
  assert len(scanned.routing) == len(unrolled.routing) == len(cfg.moe_layers)
  for r1, r2 in zip(scanned.routing, unrolled.routing):
    np.testing.assert_array_equal(np.asarray(r1.experts_nk), np.asarray(r2.experts_nk))


# "full" (block_scan under AttnRes): test_block_scan_gradients_equal_unrolled, against the
# unrolled model
# (both minutes-long gradient compiles: `long`; the default run keeps "full" remat below)
@pytest.mark.long
@pytest.mark.parametrize("policy", ["save-dots", "offload"])
def test_remat_same_gradients(model64, x64, policy):
  model = model64
  ids = _ids(model.cfg, (1, 8), 5)

  def loss(m):
    return jnp.mean(m(ids).logits ** 2)

  grad_fn = nnx.jit(nnx.grad(loss))
  g_plain = grad_fn(model)
  model.ex = model.ex.replace(remat=policy)
  try:
    g_remat = grad_fn(model)
  finally:
    model.ex = model.ex.replace(remat="none")
  # recomputation may fuse differently: float64 summation order, relative to each gradient's
  # scale (an entry can be a sum of cancelling terms larger than itself)
  for (p, a), (_, b) in zip(nnx.to_flat_state(g_plain), nnx.to_flat_state(g_remat)):
    a, b = np.asarray(a[...]), np.asarray(b[...])
    assert a.dtype == np.float64
    np.testing.assert_allclose(a, b, atol=TOL64 * max(1.0, np.abs(a).max()), rtol=0,
                               err_msg=str(p))


def test_block_scan_gradients_equal_unrolled(x64):
  """Full remat over a scan runs block_scan (the backward rebuilds each layer's block buffer
  from the final one): its gradients, through the logits and the router scores, equal the
  unrolled model's without remat. Blocks of 2 so that layer 2 seals inside the scan
  (layers 1-3), which a wrong rebuilt buffer or a lost block-gradient would show by >= 1e-3;
  float64, the tolerance as in test_remat_same_gradients."""
  cfg = tiny_cfg(num_layers=5, mla_layers=(4,), attn_res_block_size=2)
  assert [(r.start, r.count, r.scanned) for r in schedule.runs(cfg, scan=True)] == [
      (0, 1, False), (1, 3, True), (4, 1, False)]
  m = randomize(K3Model(cfg, F64, rngs=nnx.Rngs(1)))
  ids = _ids(cfg, (2, 9), 4)

  def loss(m):
    out = m(ids)
    return jnp.mean(out.logits ** 2) + sum(jnp.sum(r.scores_ne ** 2) for r in out.routing)

  grad_fn = nnx.jit(nnx.grad(loss))
  m.ex = F64.replace(scan_layers=False)
  g_plain = grad_fn(m)
  m.ex = F64.replace(remat="full")
  g_scan = grad_fn(m)
  for (p, a), (_, b) in zip(nnx.to_flat_state(g_plain), nnx.to_flat_state(g_scan)):
    a, b = np.asarray(a[...]), np.asarray(b[...])
    np.testing.assert_allclose(a, b, atol=TOL64 * max(1.0, np.abs(a).max()), rtol=0,
                               err_msg=str(p))


def test_save_attention_keeps_the_attention_through_remat(x64):
  """Save-attention remat (MLA's flash output kept: k3jax/model/saved_attention.py) on a model
  whose MLA layers run inside block_scan's scan (layers 1 and 3: the tape) and unrolled
  (layer 5: nnx.remat's named policy): its gradients equal the unrolled model's without remat
  (float64), and its compiled gradient program has full remat's matmul FLOPs less exactly one
  flash forward per MLA layer (3 blocks of 4: 6 causal block pairs of QK^T and PV each)."""
  cfg = tiny_cfg(num_layers=6, mla_layers=(1, 3, 5), attn_res_block_size=2)
  m = randomize(K3Model(cfg, F64, rngs=nnx.Rngs(1)))
  ids = _ids(cfg, (2, 9), 4)

  def compiled(ex):
    for _, module in nnx.iter_graph(m):
      if isinstance(getattr(module, "ex", None), Execution):
        module.ex = ex
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params):
      out = nnx.merge(graphdef, params, rest)(ids)
      return jnp.mean(out.logits ** 2) + sum(jnp.sum(r.scores_ne ** 2) for r in out.routing)
    program = jax.jit(jax.grad(loss)).lower(params).compile()
    return program(params), hlo.matmul_flops(program.as_text())

  flash = F64.replace(attention="flash", attention_block=4)
  g_plain, _ = compiled(flash.replace(scan_layers=False))
  _, flops_full = compiled(flash.replace(remat="full"))
  g_kept, flops_kept = compiled(flash.replace(remat="save-attention"))
  for (p, a), (_, b) in zip(nnx.to_flat_state(g_plain), nnx.to_flat_state(g_kept)):
    a, b = np.asarray(a[...]), np.asarray(b[...])
    np.testing.assert_allclose(a, b, atol=TOL64 * max(1.0, np.abs(a).max()), rtol=0,
                               err_msg=str(p))
  b, h, block = 2, cfg.mla_num_heads, 4
  pair = 2 * b * h * block * block * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                      + cfg.v_head_dim)
  assert flops_full - flops_kept == len(cfg.mla_layers) * 6 * pair


def test_schedule_maps_layers_to_stacks():
  cfg = tiny_cfg(num_layers=9, mla_layers=(3, 7, 8))  # the tiny preset's schedule
  assert [cfg.stack_index(l) for l in range(9)] == [
      (0, 0), (1, 0), (2, 1), (0, 2), (3, 3), (4, 4), (5, 5), (1, 6), (2, 7)]
  assert schedule.num_seals(cfg) == 3   # block size 3: seals at 0, 3, 6
  m = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  assert m.kda.q_proj.kernel.shape[0] == 6 and m.mla.o_proj.kernel.shape[0] == 3
  assert m.moe.experts.w1.shape[:2] == (8, cfg.num_experts)
  assert m.kda.q_proj.kernel.get_metadata()["out_sharding"] == (
      "layers", "embed", "q_heads", "head_dim")


def test_bf16_forward_is_finite():
  cfg = tiny_cfg(**SMALL)
  m = K3Model(cfg, Execution(dtype="bfloat16", param_dtype="float32"), rngs=nnx.Rngs(0))
  logits = logits_fn(m, _ids(cfg, (1, 20), 6), None)
  assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())  # the head's, wide
