"""The LM head produces float32 logits from bf16 operands on every path that scores tokens: the
model's forward (the trainer), the engine's head (k3jax/model/paged.py), the chunked loss
(k3jax/train/loss.py) and RL's chunked entropy (k3jax/rl/step.py).

Each is checked against the float64 product of the same bf16 operands (features and head, as
the path rounds them) with numerics.dot_tolerance: a float32 dot of length d is off by at most
d u sum|x w|. A logit rounded to bf16 first is off by up to half a bf16 ulp, 2^-8 of its
magnitude: 0.0625 at the logits of ~20-30 made here, far beyond that bound (what RL's engine
and trainer each rounded differently before).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.execution import Execution
from k3jax.model import paged
from k3jax.model.decode import unstack_model
from k3jax.model.transformer import K3Model
from k3jax.rl.step import _chunked_entropy
from k3jax.train.loss import chunked_token_nll
from tests.k3jax.model.helpers import randomize, tiny_cfg
from tests.numerics import dot_tolerance

BF16 = Execution(dtype="bfloat16", param_dtype="float32")


@pytest.fixture(scope="module")
def setup():
  cfg = tiny_cfg(num_layers=2, mla_layers=(1,))
  m = randomize(K3Model(cfg, BF16, rngs=nnx.Rngs(0)), seed=4)
  m.lm_head.set_value(m.lm_head[...] * 40.0)  # logits of magnitude ~20-30
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
  out = m(ids)
  features = out.features.astype(jnp.bfloat16)
  head = m.head().astype(jnp.bfloat16)
  f64, w64 = np.asarray(features, np.float64), np.asarray(head, np.float64)
  exact = f64 @ w64
  tol = dot_tolerance(np.abs(f64) @ np.abs(w64), cfg.hidden_size)
  assert np.abs(exact).max() > 16  # where bf16 rounds to 0.125 or coarser
  return m, ids, out, features, head, exact, tol


def test_the_forward_produces_float32_logits(setup):
  _, _, out, _, _, exact, tol = setup
  assert out.logits.dtype == jnp.float32
  assert np.all(np.abs(np.asarray(out.logits, np.float64) - exact) <= tol)


def test_the_engine_head_produces_float32_logits(setup):
  m, _, _, features, _, exact, tol = setup
  defs, params = unstack_model(m)
  logits = paged.logits(defs, params, features.reshape(-1, features.shape[-1]))
  assert logits.dtype == jnp.float32
  got = np.asarray(logits, np.float64).reshape(exact.shape)
  assert np.all(np.abs(got - exact) <= tol)


def _log_softmax(x):
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_the_chunked_loss_and_entropy_read_float32_logits(setup):
  """NLL and entropy over chunks of 5 positions: against the float64 ones of the exact logits,
  within what the logits' own bound moves them (|d log_softmax| <= 2 max|d logit|)."""
  _, ids, _, features, head, exact, tol = setup
  bound = 2 * tol.max() + 1e-6
  targets = jnp.roll(ids, -1, axis=1)
  nll = chunked_token_nll(features, head, targets, jnp.ones(ids.shape, bool), 5)
  lp = _log_softmax(exact)
  want = -np.take_along_axis(lp, np.asarray(targets)[..., None], -1)[..., 0]
  assert np.all(np.abs(np.asarray(nll, np.float64) - want) <= bound)
  temperature = 0.7
  ent = _chunked_entropy(features, head, 5, None, temperature)
  lpt = _log_softmax(exact / temperature)
  want = -(np.exp(lpt) * lpt).sum(-1)
  assert np.all(np.abs(np.asarray(ent, np.float64) - want) <= 2 * bound / temperature *
                np.abs(lpt).max())
  grad = jax.grad(lambda x: chunked_token_nll(x, head, targets, jnp.ones(ids.shape, bool),
                                              5).sum())(features)
  assert grad.dtype == jnp.bfloat16 and bool(jnp.isfinite(grad).all())
