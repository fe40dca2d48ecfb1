"""The chunked cross entropy equals the loss on whole logits (float64: values and gradients),
and the model's features and head feed it the same numbers as its logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from k3jax.train.loss import chunked_token_nll, token_nll

# float64, O(d + V) terms per value: rounding ~1e-16 * (d + V) * |term| with |term| <~ 10
TOL = 1e-11


def _inputs(b=2, t=13, d=16, v=37, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(ks[0], (b, t, d), jnp.float64)
  w = jax.random.normal(ks[1], (d, v), jnp.float64) * 0.5
  tg = jax.random.randint(ks[2], (b, t), 0, v)
  mask = jax.random.bernoulli(ks[3], 0.8, (b, t))
  return x, w, tg, mask


@pytest.mark.parametrize("chunk", [5, 13, 64])  # 5: T=13 padded to 15; 64 > T
def test_chunked_equals_whole_logits(x64, chunk):
  x, w, tg, mask = _inputs()
  # upstream weights per position, so the gradient checks every position's own term
  r = jax.random.uniform(jax.random.key(9), tg.shape, jnp.float64)

  def whole(x, w):
    return jnp.sum(r * token_nll(jnp.einsum("btd,dv->btv", x, w), tg, mask))

  def chunked(x, w):
    return jnp.sum(r * chunked_token_nll(x, w, tg, mask, chunk))

  np.testing.assert_allclose(chunked_token_nll(x, w, tg, mask, chunk),
                             token_nll(jnp.einsum("btd,dv->btv", x, w), tg, mask),
                             rtol=0, atol=TOL)
  ref = jax.grad(whole, argnums=(0, 1))(x, w)
  got = jax.grad(chunked, argnums=(0, 1))(x, w)
  for a, b in zip(got, ref):
    assert float(jnp.max(jnp.abs(b))) > 1e-3  # the gradient is not trivially zero
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
  # masked positions contribute exactly nothing
  assert np.all(np.asarray(chunked_token_nll(x, w, tg, mask, chunk))[~np.asarray(mask)] == 0)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_chunked_tempered_equals_whole_logits_over_t(x64, temperature):
  """`temperature` (RL's policy, softmax(x W / T)): the NLL and its gradients equal those of
  whole logits divided by T."""
  x, w, tg, mask = _inputs(seed=1)
  r = jax.random.uniform(jax.random.key(8), tg.shape, jnp.float64)

  def whole(x, w):
    return jnp.sum(r * token_nll(jnp.einsum("btd,dv->btv", x, w) / temperature, tg, mask))

  def chunked(x, w):
    return jnp.sum(r * chunked_token_nll(x, w, tg, mask, 5, temperature=temperature))

  np.testing.assert_allclose(
      chunked_token_nll(x, w, tg, mask, 5, temperature=temperature),
      token_nll(jnp.einsum("btd,dv->btv", x, w) / temperature, tg, mask), rtol=0, atol=TOL)
  ref = jax.grad(whole, argnums=(0, 1))(x, w)
  got = jax.grad(chunked, argnums=(0, 1))(x, w)
  for a, b in zip(got, ref):
    assert float(jnp.max(jnp.abs(b))) > 1e-3
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL)


def test_chunked_keeps_no_whole_logits():
  """The backward of the chunked loss holds no [B, T, V] buffer: its jaxpr has no array with
  T*V elements (per row), while the whole-logits loss has one."""
  x, w, tg, mask = (a.astype(jnp.float32) if a.dtype == jnp.float64 else a
                    for a in _inputs(t=64, v=512))
  grad = jax.grad(lambda x, w: jnp.sum(chunked_token_nll(x, w, tg, mask, 8)), (0, 1))
  text = str(jax.make_jaxpr(grad)(x, w))
  assert "2,64,512" not in text and "f32[2,8,512]" in text
  whole = jax.grad(lambda x, w: jnp.sum(token_nll(x @ w, tg, mask)), (0, 1))
  assert "f32[2,64,512]" in str(jax.make_jaxpr(whole)(x, w))


def test_model_features_and_head_give_the_logits_loss(x64):
  """What the train step feeds the chunked loss (the model's `features` without the head, and
  `model.head()`) gives the NLL of the model's own logits (float64, a 2-layer model)."""
  from flax import nnx

  from k3jax.execution import Execution
  from k3jax.model.transformer import K3Model
  cfg = configs.get("tiny", num_layers=2, mla_layers=(1,))
  ex = Execution(dtype="float64", param_dtype="float64", matmul_precision="highest")
  model = K3Model(cfg, ex, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 13)), jnp.int32)
  mask = jnp.ones((2, 12), bool)
  ref = token_nll(model(ids[:, :-1]).logits, ids[:, 1:], mask)
  out = model(ids[:, :-1], logits=False)
  assert out.logits is None
  got = chunked_token_nll(out.features, model.head(), ids[:, 1:], mask, 5)
  assert float(jnp.min(ref)) > 1.0  # real losses (vocabulary 256: ~ln 256)
  np.testing.assert_allclose(got, ref, rtol=0, atol=TOL)
