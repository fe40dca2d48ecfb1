"""Sampling rules (k3jax/generate/sampling.py) against a numpy transcription: temperature 0 is
argmax, top-k keeps the k largest, top-p the smallest most-likely set reaching p; draws land
only in the kept set and reach every token of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.generate.sampling import Sampling, filtered_logits, sample


def np_kept(logits, temperature, top_k, top_p):
  x = logits / temperature
  order = np.argsort(-x)
  keep = np.zeros_like(x, bool)
  p = np.exp(x - x.max())
  p /= p.sum()
  mass = 0.0
  for rank, i in enumerate(order):
    if (top_k and rank >= top_k) or mass >= top_p:
      break
    keep[i] = True
    mass += p[i]
  return keep


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (4, 0.3), (1, 1.0)])
def test_filter_matches_numpy(top_k, top_p):
  logits = np.random.default_rng(top_k).standard_normal((3, 20)) * 2
  got = np.asarray(filtered_logits(jnp.asarray(logits), Sampling.make(0.7, top_k, top_p)))
  for b in range(3):
    np.testing.assert_array_equal(np.isfinite(got[b]), np_kept(logits[b], 0.7, top_k, top_p))
  kept = np.isfinite(got)
  np.testing.assert_allclose(got[kept], (logits / 0.7)[kept], rtol=1e-6)


def test_draws_stay_in_the_kept_set_and_cover_it():
  logits = jnp.asarray([[2.0, 1.9, 1.8, 0.0, -1.0, -3.0]])
  s = Sampling.make(1.0, top_k=3)
  keys = jax.random.split(jax.random.key(0), 2000)
  draws = np.asarray(jax.vmap(lambda k: sample(logits, k, s))(keys))[:, 0]
  assert set(draws.tolist()) == {0, 1, 2}   # each kept token has probability > 0.3


def test_temperature_zero_is_argmax():
  logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 50)))
  got = sample(logits, jax.random.key(3), Sampling.make(0.0, top_k=5, top_p=0.2))
  np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))
