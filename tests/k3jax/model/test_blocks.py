"""RMSNorm, Projection, AttnRes, SiTU and the dense MLP against numpy transcriptions of their
formulas (docs/model.md)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from k3jax.execution import Execution
from k3jax.model.attn_res import AttnResQuery, attn_res
from k3jax.model.layers import RMSNorm
from k3jax.model.mlp import MLP, situ
from tests import numerics
from tests.k3jax.model.helpers import np64, randomize, tiny_cfg


def np_rmsnorm(x, gamma, eps):
  return gamma * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def test_rmsnorm_fp32():
  norm = randomize(RMSNorm(Execution(), 32, ("embed",), eps=1e-5))
  x = np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32) * 3
  got = norm(jnp.asarray(x))
  want = np_rmsnorm(np64(x), np64(norm.weight[...]), 1e-5)
  np.testing.assert_allclose(np64(got), want, atol=1e-5, rtol=1e-6)


def test_rmsnorm_bf16_casts_before_the_gain():
  """fp32 normalisation, cast to bf16, then a bf16 multiply by the (bf16) gain."""
  ex = Execution(dtype="bfloat16", param_dtype="bfloat16")
  norm = randomize(RMSNorm(ex, 32, ("embed",), eps=1e-5))
  x = (np.random.default_rng(1).standard_normal((4, 32)) * 5).astype(ml_dtypes.bfloat16)
  got = np.asarray(norm(jnp.asarray(x)))
  xn = np_rmsnorm(np.asarray(x, np.float32), 1.0, 1e-5).astype(ml_dtypes.bfloat16)
  want = (np.asarray(norm.weight[...]).astype(np.float32) * xn.astype(np.float32)).astype(
      ml_dtypes.bfloat16)
  assert got.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def np_attn_res(cands, w, gamma, eps):
  v = np.stack(cands)                                     # [N, B, T, d]
  k = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)
  s = np.sum(k * gamma * w, -1)                           # [N, B, T]
  a = np.exp(s - s.max(0))
  a /= a.sum(0)
  return np.sum(a[..., None] * v, 0)


@pytest.mark.parametrize("n_blocks", [0, 1, 4])
def test_attn_res_formula(n_blocks):
  rng = np.random.default_rng(n_blocks)
  cands = [rng.standard_normal((2, 3, 16)) * rng.uniform(0.5, 4) for _ in range(n_blocks + 1)]
  w, gamma = rng.standard_normal(16), rng.uniform(0.5, 1.5, 16)
  got = attn_res([jnp.asarray(c, jnp.float32) for c in cands[:-1]],
                 jnp.asarray(cands[-1], jnp.float32), jnp.asarray(w), jnp.asarray(gamma), 1e-5)
  np.testing.assert_allclose(np64(got), np_attn_res(cands, w, gamma, 1e-5), atol=1e-5)


def test_attn_res_masked_slots_are_ignored_exactly(x64):
  """Masked slots get weight exactly 0, even holding 1e3: masked == the valid slots alone.
  float64: the two differ only in summation order (5 vs 3 candidates, exact zeros among them),
  ~1e-16 of the O(1) outputs; 1e-12 holds on any machine (a leak of weight 1e-9 of a 1e3 slot
  would already show)."""
  rng = np.random.default_rng(3)
  blocks = jnp.asarray(rng.standard_normal((4, 2, 3, 16)))
  partial = jnp.asarray(rng.standard_normal((2, 3, 16)))
  w, gamma = jnp.asarray(rng.standard_normal(16)), jnp.ones(16, jnp.float64)
  valid = jnp.array([True, True, False, False, True])
  garbage = blocks.at[2:].set(1e3)
  masked = attn_res(garbage, partial, w, gamma, 1e-5, valid)
  assert masked.dtype == jnp.float64 and np.isfinite(np.asarray(masked)).all()
  np.testing.assert_allclose(np.asarray(masked),
                             np.asarray(attn_res(blocks[:2], partial, w, gamma, 1e-5)),
                             atol=1e-12, rtol=0)


def test_attn_res_zero_query_is_uniform_average():
  """w = 0: every score is exactly 0, so the mix is the plain mean of the 3 candidates. In
  float32 each weight 1/3 carries <= 2 roundings (exp, divide), each of the 3 products one and
  the 2 adds one each of at most sum|a_n v_n|: |error| <= 5 u sum_n |v_n| / 3 elementwise
  (u = 2^-24), whatever the order XLA sums in."""
  cfg = tiny_cfg()
  q = AttnResQuery(cfg, Execution())   # fresh init: w = 0, gamma = 1
  rng = np.random.default_rng(4)
  blocks = [jnp.asarray(rng.standard_normal((1, 2, 32)), jnp.float32) for _ in range(3)]
  got = q(blocks[:2], blocks[2])
  v = np.stack([np64(b) for b in blocks])
  numerics.assert_close("mean", got, v.mean(0), 5 * numerics.U32 * np.abs(v).sum(0) / 3)


def test_situ_formula_and_bounds():
  a = np.linspace(-60, 60, 241)
  b = np.linspace(-400, 400, 241)[::-1].copy()
  got = np64(situ(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 4.0, 25.0))
  want = (4 * np.tanh(a / 4) / (1 + np.exp(-a))) * (25 * np.tanh(b / 25))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.abs(got).max() <= 4 * 25


def test_mlp_situ_and_swiglu():
  rng = np.random.default_rng(5)
  x = rng.standard_normal((2, 3, 32)).astype(np.float32)
  for cfg in (tiny_cfg(), tiny_cfg(hidden_act="silu", situ_beta=1.0, situ_linear_beta=None)):
    mlp = randomize(MLP(cfg, Execution(), 48, rngs=nnx.Rngs(0)))
    wg, wu, wd = (np64(p.kernel[...]) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    a, b = np64(x) @ wg, np64(x) @ wu
    if cfg.hidden_act == "situ":
      act = 4 * np.tanh(a / 4) / (1 + np.exp(-a)) * 25 * np.tanh(b / 25)
    else:
      act = a / (1 + np.exp(-a)) * b
    np.testing.assert_allclose(np64(mlp(jnp.asarray(x))), act @ wd, atol=1e-5, rtol=1e-5)


def test_projection_keeps_master_weights_fp32():
  ex = Execution(dtype="bfloat16", param_dtype="float32")
  mlp = MLP(tiny_cfg(), ex, 48, rngs=nnx.Rngs(0))
  assert mlp.gate_proj.kernel[...].dtype == jnp.float32
  y = mlp(jnp.ones((1, 2, 32), jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  assert mlp.gate_proj.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")


@pytest.mark.parametrize("eq,x_shape,k_shape", [
    ("btd,dhk->bthk", (2, 5, 6), (6, 3, 4)),       # KDA / MLA head projections
    ("bthv,hvd->btd", (2, 5, 3, 4), (3, 4, 6)),    # their output projections
    ("...d,df->...f", (7, 6), (6, 5)),             # the MLP (any leading dims)
    ("...d,df->...f", (2, 3, 4, 6), (6, 5)),
    ("btd,dh->bth", (1, 1, 6), (6, 3)),            # a single token
    ("btd,hd->bth", (2, 5, 6), (3, 6)),            # not a projection layout: plain einsum
])
def test_flat_einsum_is_the_einsum(x64, eq, x_shape, k_shape):
  """The [tokens, in] @ [in, out] form of a projection equals its einsum, values and both
  gradients, in float64 (same products, summed in another order at most).

  Bound: every entry is a sum of n <= 24 products of two N(0, 1) values (E|ab| = 2/pi, so
  sum|terms| ~ 15); summing in another order changes it by at most ~n * eps * sum|terms| =
  24 * 1.1e-16 * 15 ~ 4e-14, which 1e-12 covers with room for the tails."""
  from k3jax.model.layers import flat_einsum
  rng = np.random.default_rng(0)
  x, k = (jnp.asarray(rng.standard_normal(s)) for s in (x_shape, k_shape))
  ct = jnp.asarray(rng.standard_normal(jnp.einsum(eq, x, k).shape))
  got, vjp_got = jax.vjp(lambda x, k: flat_einsum(eq, x, k), x, k)
  want, vjp_want = jax.vjp(lambda x, k: jnp.einsum(eq, x, k), x, k)
  assert got.shape == want.shape and got.dtype == jnp.float64
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
  for g, w in zip(vjp_got(ct), vjp_want(ct)):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
