"""The whole model on tiny configs: causal (shown with gradients), deterministic, packed
sequences independent, scanned == unrolled, remat == plain, schedule and stacks correct."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.model import schedule
from k3jax.model.transformer import K3Model
from tests.k3jax.model.helpers import kimi_linear_cfg, randomize, tiny_cfg


@pytest.fixture(scope="module")
def model():
  return randomize(K3Model(tiny_cfg(num_layers=9, mla_layers=(3, 7, 8)), rngs=nnx.Rngs(0)))


def _ids(cfg, shape, seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size)


def test_causal_by_gradient(model):
  """d logits[:, t] / d inputs_embeds[:, s] is exactly zero for every s > t, and not for s <= t."""
  cfg = model.cfg
  emb = model.embed[...][_ids(cfg, (1, 12))]
  t = 5

  def logit_sum(e):
    return model(inputs_embeds=e).logits[:, t].sum()

  g = np.asarray(jax.grad(logit_sum)(emb))
  assert np.all(g[:, t + 1:] == 0)
  assert np.all(np.abs(g[:, : t + 1]).sum(-1) > 0)


def test_deterministic(model):
  ids = _ids(model.cfg, (2, 10), 1)
  a = np.asarray(model(ids).logits)
  b = np.asarray(model(ids).logits)
  np.testing.assert_array_equal(a, b)
  again = randomize(K3Model(model.cfg, rngs=nnx.Rngs(0)))
  np.testing.assert_array_equal(np.asarray(again(ids).logits), a)


def test_packed_sequences_do_not_interact(model):
  cfg = model.cfg
  a, b = _ids(cfg, (1, 7), 2), _ids(cfg, (1, 9), 3)
  packed = model(jnp.concatenate([a, b], 1),
                 segment_ids=jnp.asarray([[1] * 7 + [2] * 9])).logits
  np.testing.assert_allclose(np.asarray(packed[:, :7]), np.asarray(model(a).logits), atol=2e-5)
  np.testing.assert_allclose(np.asarray(packed[:, 7:]), np.asarray(model(b).logits), atol=2e-5)


@pytest.mark.parametrize("make", [lambda: tiny_cfg(num_layers=13, mla_layers=(3, 7, 11, 12)),
                                  kimi_linear_cfg])
def test_scanned_equals_unrolled(make):
  cfg = make()
  runs = schedule.plan(cfg, scan=True)
  assert any(r.scanned for r in runs)
  m = randomize(K3Model(cfg, rngs=nnx.Rngs(1)))
  ids = _ids(cfg, (2, 9), 4)
  scanned = m(ids)
  m.cfg = cfg.replace(scan_layers=False)
  unrolled = m(ids)
  np.testing.assert_allclose(np.asarray(scanned.logits), np.asarray(unrolled.logits), atol=1e-5)
  assert len(scanned.routing) == len(unrolled.routing) == len(cfg.moe_layers)
  for r1, r2 in zip(scanned.routing, unrolled.routing):
    np.testing.assert_array_equal(np.asarray(r1.experts_nk), np.asarray(r2.experts_nk))


def test_remat_same_gradients(model):
  ids = _ids(model.cfg, (1, 8), 5)

  def loss(m):
    return jnp.mean(m(ids).logits ** 2)

  g_plain = nnx.grad(loss)(model)
  model.cfg = model.cfg.replace(remat=True)
  try:
    g_remat = nnx.grad(loss)(model)
  finally:
    model.cfg = model.cfg.replace(remat=False)
  for (p, a), (_, b) in zip(nnx.to_flat_state(g_plain), nnx.to_flat_state(g_remat)):
    np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), atol=1e-6, err_msg=str(p))


def test_schedule_maps_layers_to_stacks():
  cfg = tiny_cfg(num_layers=9, mla_layers=(3, 7, 8))
  assert [cfg.stack_index(l) for l in range(9)] == [
      (0, 0), (1, 0), (2, 1), (0, 2), (3, 3), (4, 4), (5, 5), (1, 6), (2, 7)]
  assert schedule.num_seals(cfg) == 3   # block size 3: seals at 0, 3, 6
  m = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  assert m.kda.q_proj.kernel.shape[0] == 6 and m.mla.o_proj.kernel.shape[0] == 3
  assert m.moe.experts.w1.shape[:2] == (8, cfg.num_experts)
  assert m.kda.q_proj.kernel.get_metadata()["out_sharding"] == (
      "layers", "embed", "q_heads", "head_dim")


def test_bf16_forward_is_finite():
  cfg = tiny_cfg(dtype="bfloat16", param_dtype="float32")
  m = K3Model(cfg, rngs=nnx.Rngs(0))
  logits = m(_ids(cfg, (1, 20), 6)).logits
  assert logits.dtype == jnp.bfloat16 and bool(jnp.isfinite(logits).all())
