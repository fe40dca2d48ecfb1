"""Per-Head Muon (docs/training.md): Newton-Schulz, grouping by logical names, per-block updates,
RMS scale, decoupled weight decay, dtype stability, and QK-clip.

The references are independent of the code under test: a float64 numpy transcription of the
quintic iteration, a hand-written table of every parameter's group and blocks, and optax's own
2-D Muon / AdamW run on each block in a Python loop, in float64. float32 results are compared
with those float64 truths under the bounds derived below (docs/correctness.md).
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.optim import (
  NS_COEFFS,
  logical_axes_from_state,
  muon_weight_dimension_numbers,
  newton_schulz,
  param_labels,
  per_head_muon,
  qk_clip,
  qk_clip_factors,
)
from k3jax.optim.groups import block_shape

# ---- a small K3-shaped parameter tree ------------------------------------------------------
D, V = 16, 20                      # embed, vocab
H, K, R, CONV = 2, 4, 4, 4         # KDA heads, head_dim, gate_rank, conv taps
QL, KVL, NOPE, ROPE, VD = 8, 8, 4, 2, 4   # MLA q_lora, kv_lora (incl. rope), dims
E, LAT, FM, FF = 3, 8, 6, 10       # experts, latent, moe_mlp, mlp
L = 2                              # layers per stack

# path: (shape, names, group, (blocks, fan_in, fan_out) or None, batch axes of the block loop)
TABLE = {
    "kda/q_proj": ((L, D, H, K), ("layers", "embed", "q_heads", "head_dim"), "muon",
                   (L * H, D, K), (0, 2)),
    "kda/k_proj": ((L, D, H, K), ("layers", "embed", "kv_heads", "head_dim"), "muon",
                   (L * H, D, K), (0, 2)),
    "kda/v_proj": ((L, D, H, K), ("layers", "embed", "kv_heads", "head_dim"), "muon",
                   (L * H, D, K), (0, 2)),
    "kda/q_conv": ((L, H, K, CONV), ("layers", "heads", "head_dim", "conv"), "adam", None, None),
    "kda/k_conv": ((L, H, K, CONV), ("layers", "heads", "head_dim", "conv"), "adam", None, None),
    "kda/v_conv": ((L, H, K, CONV), ("layers", "heads", "head_dim", "conv"), "adam", None, None),
    "kda/f_a_proj": ((L, D, R), ("layers", "embed", "gate_rank"), "muon", (L, D, R), (0,)),
    "kda/f_b_proj": ((L, R, H, K), ("layers", "gate_rank", "heads", "head_dim"), "muon",
                     (L, R, H * K), (0,)),
    "kda/A_log": ((L, H), ("layers", "heads"), "adam", None, None),
    "kda/dt_bias": ((L, H, K), ("layers", "heads", "head_dim"), "adam", None, None),
    "kda/b_proj": ((L, D, H), ("layers", "embed", "heads"), "muon", (L, D, H), (0,)),
    "kda/g_proj": ((L, D, H, K), ("layers", "embed", "heads", "head_dim"), "muon",
                   (L, D, H * K), (0,)),
    "kda/g_a_proj": ((L, D, R), ("layers", "embed", "gate_rank"), "muon", (L, D, R), (0,)),
    "kda/g_b_proj": ((L, R, H, K), ("layers", "gate_rank", "heads", "head_dim"), "muon",
                     (L, R, H * K), (0,)),
    "kda/o_norm": ((L, K), ("layers", "head_dim"), "adam", None, None),
    "kda/o_proj": ((L, H, K, D), ("layers", "heads", "head_dim", "embed"), "muon",
                   (L, H * K, D), (0,)),
    "mla/q_a_proj": ((L, D, QL), ("layers", "embed", "q_lora"), "muon", (L, D, QL), (0,)),
    "mla/q_a_norm": ((L, QL), ("layers", "q_lora"), "adam", None, None),
    "mla/q_b_proj": ((L, QL, H, NOPE + ROPE), ("layers", "q_lora", "q_heads", "qk_head_dim"),
                     "muon", (L * H, QL, NOPE + ROPE), (0, 2)),
    "mla/kv_a_proj": ((L, D, KVL), ("layers", "embed", "kv_lora"), "muon", (L, D, KVL), (0,)),
    "mla/kv_a_norm": ((L, KVL - ROPE), ("layers", "kv_lora"), "adam", None, None),
    "mla/k_b_proj": ((L, KVL - ROPE, H, NOPE), ("layers", "kv_lora", "kv_heads", "qk_nope_dim"),
                     "muon", (L * H, KVL - ROPE, NOPE), (0, 2)),
    "mla/v_b_proj": ((L, KVL - ROPE, H, VD), ("layers", "kv_lora", "kv_heads", "head_dim"),
                     "muon", (L * H, KVL - ROPE, VD), (0, 2)),
    "mla/g_proj": ((L, D, H, VD), ("layers", "embed", "heads", "head_dim"), "muon",
                   (L, D, H * VD), (0,)),
    "mla/o_proj": ((L, H, VD, D), ("layers", "heads", "head_dim", "embed"), "muon",
                   (L, H * VD, D), (0,)),
    "mla_plain/q_proj": ((L, D, H, NOPE + ROPE), ("layers", "embed", "q_heads", "qk_head_dim"),
                         "muon", (L * H, D, NOPE + ROPE), (0, 2)),
    "mla_plain/k_b_proj": ((L, KVL - ROPE, H, NOPE),
                           ("layers", "kv_lora", "kv_heads", "qk_nope_dim"), "muon",
                           (L * H, KVL - ROPE, NOPE), (0, 2)),
    "moe/router": ((L, D, E), ("layers", "embed", "expert_scores"), "muon", (L, D, E), (0,)),
    "moe/routed_down": ((L, D, LAT), ("layers", "embed", "latent"), "muon", (L, D, LAT), (0,)),
    "moe/latent_norm": ((L, LAT), ("layers", "latent"), "adam", None, None),
    "moe/routed_up": ((L, LAT, D), ("layers", "latent", "embed"), "muon", (L, LAT, D), (0,)),
    "moe/w1": ((L, E, LAT, FM), ("layers", "experts", "latent", "moe_mlp"), "muon",
               (L * E, LAT, FM), (0, 1)),
    "moe/w3": ((L, E, LAT, FM), ("layers", "experts", "latent", "moe_mlp"), "muon",
               (L * E, LAT, FM), (0, 1)),
    "moe/w2": ((L, E, FM, LAT), ("layers", "experts", "moe_mlp", "latent"), "muon",
               (L * E, FM, LAT), (0, 1)),
    "moe/shared_gate": ((L, D, FF), ("layers", "embed", "mlp"), "muon", (L, D, FF), (0,)),
    "moe/shared_up": ((L, D, FF), ("layers", "embed", "mlp"), "muon", (L, D, FF), (0,)),
    "moe/shared_down": ((L, FF, D), ("layers", "mlp", "embed"), "muon", (L, FF, D), (0,)),
    "dense/gate": ((1, D, FF), ("layers", "embed", "mlp"), "muon", (1, D, FF), (0,)),
    "dense/up": ((1, D, FF), ("layers", "embed", "mlp"), "muon", (1, D, FF), (0,)),
    "dense/down": ((1, FF, D), ("layers", "mlp", "embed"), "muon", (1, FF, D), (0,)),
    "embedding": ((V, D), ("vocab", "embed"), "adam", None, None),
    "lm_head": ((D, V), ("embed", "vocab"), "adam", None, None),
    "final_norm": ((D,), ("embed",), "adam", None, None),
    "layer_norms": ((L, D), ("layers", "embed"), "adam", None, None),
    "attn_res_query": ((L, D), ("layers", "embed"), "adam", None, None),
    "output_res_query": ((D,), ("embed",), "adam", None, None),
}


class RouterBias(nnx.Variable):
  """Stand-in for the model's router bias: a Variable that is not an nnx.Param."""


class Synthetic(nnx.Module):
  """Every parameter of TABLE as an nnx.Param with logical names, nested like a model."""

  def __init__(self, paths=tuple(TABLE), dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    groups: dict[str, dict] = {"moe": {}}
    with nnx.use_eager_sharding(False):
      for path in paths:
        shape, names = TABLE[path][:2]
        *mods, leaf = path.split("/")
        node = groups
        for m in mods:
          node = node.setdefault(m, {})
        node[leaf] = nnx.Param(jnp.asarray(rng.normal(size=shape) * 0.5, dtype),
                               out_sharding=names)
      groups["moe"]["router_bias"] = RouterBias(jnp.zeros((L, E), jnp.float32),
                                                out_sharding=("layers", "expert_scores"))
    for name, sub in groups.items():
      setattr(self, name, nnx.data(sub) if isinstance(sub, dict) else sub)


def flat_by_path(tree):
  """{"a/b": leaf} of a State / dict tree (Variables or arrays as leaves)."""
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, nnx.Variable) or isinstance(x, tuple)
      or x is None or isinstance(x, optax.MaskedNode))[0]
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p): v
          for p, v in leaves}


def random_like(state, seed, dtype=None):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(rng.normal(size=x.shape), dtype or x.dtype), nnx.as_pure(state))


# one parameter of every layout for the (compile-heavy) update tests: per-head query / key,
# per-head MLA q_b / k_b, feature-first and feature-last 3-axis matrices, experts, router,
# vocab tables, and non-matrices
SUBSET = ("kda/q_proj", "kda/k_proj", "kda/f_b_proj", "kda/o_proj", "kda/dt_bias",
          "kda/q_conv", "mla/q_b_proj", "mla/k_b_proj", "moe/router", "moe/w2", "embedding",
          "lm_head", "final_norm")


@pytest.fixture(scope="module")
def model():
  return Synthetic()


@pytest.fixture(scope="module")
def params_state(model):
  return nnx.state(model, nnx.Param)


@pytest.fixture(scope="module")
def small_state():
  return nnx.state(Synthetic(SUBSET), nnx.Param)


# ---- Newton-Schulz ---------------------------------------------------------------------------
# float32 error growth. The quintic f(x) = a x + b x^3 + c x^5 acts on each singular value, and
# the iterates' singular values stay in [0, 1.21] (quintic_band); there |f'| <= 4 (checked in
# test_newton_schulz_is_near_orthogonal), so each of the 5 iterations amplifies an earlier
# rounding at most 4x: the input's rounding (relative u = 2^-24) grows to <= 4^5 u = 2^10 u of
# the output's scale. Each iteration's own rounding is amplified less (4^4 u, 4^3 u, ...: a
# third more in all, in the worst direction only). NS_TOL = 2^10 u of the output's largest
# entry; measured 12-43 u for k3jax's Newton-Schulz, ~280 u for optax's float32 Muon.
NS_SLOPE = 4.0
NS_TOL = 2.0**-14  # 2^10 u


def ns_tolerance(want):
  return NS_TOL * np.abs(want).max()


# AdamW is elementwise: ~15 roundings (moments, bias corrections, sqrt, divide, learning rate,
# weight decay), each <= u of the update's scale: 32 u; measured <= 5.2 u.
ADAM_TOL = 32 * 2.0**-24


def ns_numpy(x, steps=5, eps=1e-7):
  """Float64 transcription: one matrix at a time, transpose tall, Frobenius-normalise."""
  a, b, c = NS_COEFFS
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (np.sqrt(np.sum(x * x)) + eps)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


@pytest.mark.parametrize("shape", [(3, 12, 5), (2, 2, 5, 12), (7, 7), (1, 40, 8)])
def test_newton_schulz_matches_float64_numpy(shape):
  x = np.random.default_rng(1).normal(size=shape)
  got = np.asarray(newton_schulz(jnp.asarray(x, jnp.float32)))
  assert got.dtype == np.float32 and got.shape == shape
  want = np.stack([ns_numpy(m) for m in x.reshape(-1, *shape[-2:])]).reshape(shape)
  np.testing.assert_allclose(got, want, atol=ns_tolerance(want), rtol=0)


def test_newton_schulz_float64_is_exact_transcription(x64):
  x = np.random.default_rng(2).normal(size=(4, 9, 6))
  got = np.asarray(newton_schulz(jnp.asarray(x, jnp.float64)))
  assert got.dtype == np.float64
  np.testing.assert_allclose(got, np.stack([ns_numpy(m) for m in x]), atol=1e-13, rtol=0)


def test_newton_schulz_bf16_input_computes_in_float32():
  x = np.random.default_rng(3).normal(size=(2, 8, 24))
  x_bf16 = jnp.asarray(x, jnp.bfloat16)
  got = newton_schulz(x_bf16)
  assert got.dtype == jnp.float32
  want = np.stack([ns_numpy(m) for m in np.asarray(x_bf16.astype(jnp.float32))])
  np.testing.assert_allclose(np.asarray(got), want, atol=ns_tolerance(want), rtol=0)


def quintic_band():
  """The interval the iterated quintic settles in: [f(x2), f(x1)] at its critical points."""
  a, b, c = NS_COEFFS
  f = lambda x: a * x + b * x**3 + c * x**5
  # f'(x) = a + 3b x^2 + 5c x^4 = 0: a quadratic in x^2 with two positive roots x1 < x2;
  # f peaks at x1 and dips at x2, and [f(x2), f(x1)] maps into itself
  x1, x2 = np.sqrt(np.sort(np.roots([5 * c, 3 * b, a]).real))
  return f(x2), f(x1)


def test_newton_schulz_is_near_orthogonal():
  lo, hi = quintic_band()
  assert 0.68 < lo < 0.69 and 1.20 < hi < 1.21
  a, b, c = NS_COEFFS  # the slope bound behind NS_TOL, over every singular value NS visits
  x = np.linspace(0.0, hi, 10001)
  assert np.abs(a + 3 * b * x**2 + 5 * c * x**4).max() <= NS_SLOPE
  rng = np.random.default_rng(4)
  x = rng.normal(size=(5, 64, 32))
  o = np.asarray(newton_schulz(jnp.asarray(x, jnp.float32)), np.float64)
  for xi, oi in zip(x, o):
    u, _, vt = np.linalg.svd(xi, full_matrices=False)
    s = np.linalg.svd(oi, compute_uv=False)
    assert lo - 1e-4 <= s.min() and s.max() <= hi + 1e-4
    # a polynomial in X X^T times X keeps the singular vectors: U^T O V is diagonal, up to
    # O's float32 error (independent zero-mean roundings keep their size under a rotation)
    core = u.T @ oi @ vt.T
    np.testing.assert_allclose(core - np.diag(np.diag(core)), 0, atol=ns_tolerance(oi))


# ---- grouping ------------------------------------------------------------------------------
def test_logical_axes_and_groups_follow_the_table(params_state):
  axes = flat_by_path(logical_axes_from_state(params_state))
  assert set(axes) == set(TABLE)  # the RouterBias is not a Param, so it is not here
  labels = flat_by_path(param_labels(logical_axes_from_state(params_state)))
  dims = flat_by_path(muon_weight_dimension_numbers(logical_axes_from_state(params_state)))
  for path, (shape, names, group, blocks, _) in TABLE.items():
    assert axes[path] == names, path
    assert labels[path] == group, path  # exactly one group per parameter
    if group == "muon":
      assert block_shape(shape, dims[path]) == blocks, path
    else:
      assert dims[path] is None, path


def test_only_params_reach_the_optimizer(model):
  with pytest.raises(ValueError, match="RouterBias is not an nnx.Param"):
    logical_axes_from_state(nnx.state(model))
  with nnx.use_eager_sharding(False):
    bare = nnx.Param(jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="no logical axis names"):
    logical_axes_from_state({"w": bare})


def test_optimizer_state_holds_exactly_the_two_groups(params_state):
  tx = per_head_muon(0.1, logical_axes=logical_axes_from_state(params_state))
  state = tx.init(nnx.as_pure(params_state))
  muon_mu = flat_by_path(state.inner_states["muon"].inner_state[0].mu)
  adam_mu = flat_by_path(state.inner_states["adam"].inner_state[0].mu)
  has_state = lambda d: {p for p, v in d.items() if not isinstance(v, optax.MaskedNode)}
  want_muon = {p for p, row in TABLE.items() if row[2] == "muon"}
  assert has_state(muon_mu) == want_muon
  assert has_state(adam_mu) == set(TABLE) - want_muon


# ---- the update against a loop of plain (2-D) Muon / AdamW ---------------------------------
def blocks_of(x, batch_axes):
  """{batch index: block}: index the batch axes with integers; the remaining axes, in order,
  are (reduction side..., output side...) for every table entry, so a plain reshape to
  (fan_in, fan_out) gives the 2-D block."""
  x = np.asarray(x)
  out = {}
  for idx in np.ndindex(*[x.shape[a] for a in batch_axes]):
    full = [slice(None)] * x.ndim
    for a, i in zip(batch_axes, idx):
      full[a] = i
    out[idx] = x[tuple(full)]
  return out


def test_update_equals_loop_of_plain_muon_and_adamw(small_state):
  lr, wd, steps = 0.05, 0.1, 3
  sched = optax.linear_schedule(lr, lr / 2, steps)
  params = nnx.as_pure(small_state)
  tx = per_head_muon(sched, logical_axes=logical_axes_from_state(small_state),
                     weight_decay=wd)
  state = tx.init(params)
  grad_trees = [random_like(small_state, 10 + t) for t in range(steps)]
  update = jax.jit(tx.update)
  got = []
  for t in range(steps):
    updates, state = update(grad_trees[t], state, params)
    params = optax.apply_updates(params, updates)
    got.append(flat_by_path(updates))

  # reference, in float64 on the same values: every Muon block is its own 2-D parameter of
  # optax's Muon (consistent RMS 0.2, same eps); every other parameter its own AdamW (decay
  # only on vocab tables)
  ref_params, ref_map = {}, {}
  flat_p = flat_by_path(nnx.as_pure(small_state))
  for path in SUBSET:
    shape, names, group, blocks, batch_axes = TABLE[path]
    if group == "muon":
      for idx, sub in blocks_of(flat_p[path], batch_axes).items():
        ref_params[(path, idx)] = sub.reshape(blocks[1], blocks[2]).astype(np.float64)
        ref_map[(path, idx)] = "muon"
    else:
      ref_params[(path, ())] = np.asarray(flat_p[path], np.float64)
      ref_map[(path, ())] = "adam_decay" if "vocab" in names else "adam"
  ref_tx = optax.partition({
      "muon": optax.contrib.muon(sched, eps=1e-7, weight_decay=wd, consistent_rms=0.2,
                                 muon_weight_dimension_numbers=lambda p: jax.tree.map(
                                     lambda _: optax.contrib.MuonDimensionNumbers(), p)),
      "adam_decay": optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd),
      "adam": optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0),
  }, ref_map)

  with jax.enable_x64(True):
    ref_params = jax.tree.map(jnp.asarray, ref_params)
    ref_state = ref_tx.init(ref_params)
    ref_update = jax.jit(ref_tx.update)
    for t in range(steps):
      g_flat = flat_by_path(grad_trees[t])
      ref_g = {}
      for (path, idx) in ref_params:
        row = TABLE[path]
        if row[2] == "muon":
          sub = blocks_of(g_flat[path], row[4])[idx].reshape(row[3][1], row[3][2])
        else:
          sub = np.asarray(g_flat[path])
        ref_g[(path, idx)] = jnp.asarray(sub, jnp.float64)
      ref_updates, ref_state = ref_update(ref_g, ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, ref_updates)

      for (path, idx), ref_u in ref_updates.items():
        row = TABLE[path]
        ref_u = np.asarray(ref_u)
        if row[2] == "muon":
          got_u = blocks_of(got[t][path], row[4])[idx].reshape(row[3][1], row[3][2])
          tol = ns_tolerance(ref_u)
        else:
          got_u = np.asarray(got[t][path])
          tol = ADAM_TOL * np.abs(ref_u).max()
        np.testing.assert_allclose(got_u, ref_u, atol=tol, rtol=0,
                                   err_msg=f"step {t} {path} {idx}")


def test_muon_update_rms_is_0p2(small_state):
  """Orthogonalised, a fan_in x fan_out block U S' V^T has RMS sqrt(mean(S'^2) / max(fan_in,
  fan_out)); times 0.2 * sqrt(max) the update RMS is 0.2 * RMS(S'): exactly 0.2 for an exact
  U V^T, and within 0.2 x the quintic band for Newton-Schulz. Step 1's momentum is a multiple
  of the gradient, so each block's update is 0.2 * sqrt(max) * NS(gradient block)."""
  lo, hi = quintic_band()
  tx = per_head_muon(1.0, logical_axes=logical_axes_from_state(small_state), weight_decay=0.0)
  params = nnx.as_pure(small_state)
  grads = random_like(small_state, 20)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  got, g_flat = flat_by_path(updates), flat_by_path(grads)
  checked = 0
  for path in SUBSET:
    shape, names, group, blocks, batch_axes = TABLE[path]
    if group != "muon":
      continue
    _, m, n = blocks
    for idx, u in blocks_of(got[path], batch_axes).items():
      u = np.asarray(u, np.float64).reshape(m, n)
      g = blocks_of(g_flat[path], batch_axes)[idx].reshape(m, n).astype(np.float64)
      rms = np.sqrt(np.mean(u**2))  # update RMS (lr = 1, no decay: the update is -u)
      np.testing.assert_allclose(rms, 0.2 * math.sqrt(max(m, n)) * np.sqrt(np.mean(
          ns_numpy(g)**2)), rtol=1e-5, err_msg=f"{path} {idx}")
      uu, _, vt = np.linalg.svd(g, full_matrices=False)
      assert abs(0.2 * math.sqrt(max(m, n)) * np.sqrt(np.mean((uu @ vt)**2)) - 0.2) < 1e-12
      s_g = np.linalg.svd(g, compute_uv=False)
      if s_g.min() / s_g.max() > 0.02:  # 5 steps lift every singular value into the band
        assert 0.2 * lo - 1e-5 <= rms <= 0.2 * hi + 1e-5, (path, idx, rms)
        checked += 1
  assert checked >= 25


# ---- dtypes, weight decay, nnx.Optimizer ---------------------------------------------------
def shapes_dtypes(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.mark.parametrize("param_dtype,mu_dtype", [(jnp.float32, None), (jnp.bfloat16, None),
                                                  (jnp.bfloat16, jnp.float32)])
def test_state_keeps_dtype_and_shape_under_jit(small_state, param_dtype, mu_dtype):
  tx = per_head_muon(optax.warmup_cosine_decay_schedule(0.0, 0.02, 2, 10),
                     logical_axes=logical_axes_from_state(small_state), mu_dtype=mu_dtype)
  params = jax.tree.map(lambda x: x.astype(param_dtype), nnx.as_pure(small_state))
  state = tx.init(params)
  before = shapes_dtypes(state)
  update = jax.jit(tx.update)
  for t in range(3):
    updates, state = update(random_like(small_state, 30 + t, param_dtype), state, params)
    params = optax.apply_updates(params, updates)
    assert shapes_dtypes(state) == before
    # updates come in the moments' dtype (optax's convention; apply_updates casts back)
    want_u = jnp.promote_types(param_dtype, mu_dtype or param_dtype)
    assert {u.dtype for u in jax.tree.leaves(updates)} == {want_u}
    assert shapes_dtypes(params) == shapes_dtypes(jax.tree.map(
        lambda x: x.astype(param_dtype), nnx.as_pure(small_state)))
    assert all(bool(jnp.all(jnp.isfinite(u.astype(jnp.float32))))
               for u in jax.tree.leaves(updates))
  moments = flat_by_path(state.inner_states["muon"].inner_state[0].mu)
  want = jnp.dtype(mu_dtype or param_dtype)
  assert {m.dtype for m in moments.values() if not isinstance(m, optax.MaskedNode)} == {want}


def test_weight_decay_is_decoupled(small_state):
  """The decay term is lr * wd * W, added after (not fed through) Newton-Schulz or Adam's
  normalisation: the update with decay minus the update without is exactly -lr * wd * W for
  Muon matrices and vocab tables, and zero for gains / conv / dt_bias."""
  lr = optax.linear_schedule(0.3, 0.1, 5)
  axes = logical_axes_from_state(small_state)
  params = nnx.as_pure(small_state)
  grads = random_like(small_state, 40)
  txs = [per_head_muon(lr, logical_axes=axes, weight_decay=wd) for wd in (0.0, 0.25)]

  @jax.jit
  def second_updates(grads, params):  # lr(1) is used at the second step
    out = []
    for tx in txs:
      _, state = tx.update(grads, tx.init(params), params)
      out.append(flat_by_path(tx.update(grads, state, params)[0]))
    return out

  out = dict(zip((0.0, 0.25), second_updates(grads, params)))
  flat_p = flat_by_path(params)
  for path in SUBSET:
    names, group = TABLE[path][1], TABLE[path][2]
    decays = group == "muon" or "vocab" in names
    want = -float(lr(1)) * 0.25 * np.asarray(flat_p[path]) if decays else 0.0
    np.testing.assert_allclose(np.asarray(out[0.25][path]) - np.asarray(out[0.0][path]), want,
                               atol=1e-6, rtol=0, err_msg=path)


def test_nnx_optimizer_updates_params_not_the_router_bias():
  model = Synthetic(SUBSET + ("mla/kv_a_proj",))
  params0 = nnx.as_pure(nnx.state(model, nnx.Param))
  tx = per_head_muon(0.05, logical_axes=nnx.state(model, nnx.Param))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert all(not isinstance(v, RouterBias) for v in jax.tree.leaves(
      nnx.state(optimizer), is_leaf=lambda x: isinstance(x, nnx.Variable)))
  coeffs = random_like(nnx.state(model, nnx.Param), 50)

  @nnx.jit
  def step(model, optimizer):
    def loss(m):
      p = nnx.as_pure(nnx.state(m, nnx.Param))
      return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(coeffs)))
    grads = nnx.grad(loss)(model)
    optimizer.update(model, grads)

  step(model, optimizer)
  step(model, optimizer)
  # the same two steps on plain arrays, in float64
  p, tol = two_steps_float64(tx, params0, [coeffs] * 2)
  got = nnx.as_pure(nnx.state(model, nnx.Param))
  for a, b, t in zip(jax.tree.leaves(got), jax.tree.leaves(p), jax.tree.leaves(tol)):
    np.testing.assert_allclose(np.asarray(a), b, atol=t, rtol=0)
  np.testing.assert_array_equal(np.asarray(model.moe["router_bias"][...]), 0.0)


def two_steps(tx, params, grads):
  update = jax.jit(tx.update)
  state = jax.jit(tx.init)(params)
  for g in grads:
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
  return params


def two_steps_float64(tx, params, grads):
  """The steps of `two_steps` in float64 on the same values -> (params, tolerance per leaf).

  A float32 run is within NS_TOL of each step's largest update of the leaf (Muon; AdamW's 32 u
  is smaller): the tolerance is NS_TOL times their sum."""
  with jax.enable_x64(True):
    f64 = lambda tree: jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.float64), tree)
    params = f64(params)
    update = jax.jit(tx.update)
    state = jax.jit(tx.init)(params)
    tol = jax.tree.map(lambda x: 0.0, params)
    for g in grads:
      u, state = update(f64(g), state, params)
      params = optax.apply_updates(params, u)
      tol = jax.tree.map(lambda t, x: t + NS_TOL * float(jnp.abs(x).max()), tol, u)
    return jax.tree.map(np.asarray, params), tol


@pytest.fixture(scope="module")
def one_device_two_steps(small_state):
  tx = per_head_muon(0.05, logical_axes=logical_axes_from_state(small_state))
  grads = [random_like(small_state, 60 + t) for t in range(2)]
  return tx, grads, two_steps_float64(tx, nnx.as_pure(small_state), grads)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_update_equals_one_device(small_state, one_device_two_steps, axis_type):
  """Params placed by the logical-axis rules on a (data 1, fsdp 4, expert 1, context 1, tensor 2)
  mesh of 8 CPU devices: two jitted steps give the single-device numbers, computed in float64
  (docs/correctness.md's 1e-5 is met with room: the float32 bound per leaf, two_steps_float64, is <=
  7e-6)."""
  from jax.sharding import NamedSharding

  from sharding.rules import MESH_AXES, logical_to_spec
  mesh = jax.make_mesh((1, 4, 1, 1, 2), MESH_AXES,
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 5)
  axes = logical_axes_from_state(small_state)
  tx, grads, (want, tol) = one_device_two_steps
  params = nnx.as_pure(small_state)
  place = lambda tree: jax.tree.map(
      lambda x, n: jax.device_put(x, NamedSharding(mesh, logical_to_spec(n, mesh=mesh,
                                                                        shape=x.shape))),
      tree, axes)
  assert "tensor" in str(place(params)["kda"]["q_proj"].sharding.spec)

  with jax.set_mesh(mesh) if axis_type == "Explicit" else contextlib.nullcontext():
    got = two_steps(tx, place(params), [place(g) for g in grads])
  for a, b, t in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(tol)):
    assert t <= 1e-5
    np.testing.assert_allclose(np.asarray(a), b, atol=t, rtol=0)


# ---- QK-clip -------------------------------------------------------------------------------
def mla_logits(q_b, k_b, kv_a, cq, ckv, x):
  """Pre-softmax logits of every (layer, head) from weights: [L, H, Tq, Tk], float64.
  q = cq q_b; k = [ckv k_b | x kv_a[:, rope part]] (the rope key is shared by the heads)."""
  q_b, k_b, kv_a = (np.asarray(a, np.float64) for a in (q_b, k_b, kv_a))
  out = np.zeros((L, H, cq.shape[0], x.shape[0]))
  for layer in range(L):
    k_rope = x @ kv_a[layer][:, KVL - ROPE:]
    for h in range(H):
      q = cq @ q_b[layer, :, h, :]
      k_nope = ckv @ k_b[layer, :, h, :]
      out[layer, h] = (q[:, :NOPE] @ k_nope.T + q[:, NOPE:] @ k_rope.T) / math.sqrt(NOPE + ROPE)
  return out


def test_qk_clip_factors():
  np.testing.assert_allclose(qk_clip_factors(jnp.array([50.0, 100.0, 101.0, 400.0])),
                             [1.0, 1.0, 100 / 101, 0.25], rtol=1e-7)


def test_qk_clip_scales_exactly_the_right_slices():
  model = Synthetic([p for p in TABLE if p.startswith("mla/")])
  state = nnx.state(model, nnx.Param)
  before = {k: np.asarray(v) for k, v in flat_by_path(nnx.as_pure(state)).items()}
  max_logits = jnp.array([[50.0, 400.0], [100.0, 250.0]])  # [layers, heads]
  gamma = np.array([[1.0, 0.25], [1.0, 0.4]])

  clipped = qk_clip(state, max_logits, threshold=100.0)
  assert all(isinstance(v, nnx.Param) for v in jax.tree.leaves(
      clipped, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  after = {k: np.asarray(v) for k, v in flat_by_path(nnx.as_pure(clipped)).items()}

  want_q = before["mla/q_b_proj"].copy()
  want_k = before["mla/k_b_proj"].copy()
  for layer in range(L):
    for h in range(H):
      want_q[layer, :, h, :NOPE] *= math.sqrt(gamma[layer, h])
      want_q[layer, :, h, NOPE:] *= gamma[layer, h]
      want_k[layer, :, h, :] *= math.sqrt(gamma[layer, h])
  np.testing.assert_allclose(after["mla/q_b_proj"], want_q, rtol=1e-6, atol=0)
  np.testing.assert_allclose(after["mla/k_b_proj"], want_k, rtol=1e-6, atol=0)
  for path in before:
    if path not in ("mla/q_b_proj", "mla/k_b_proj"):  # shared rope key, values, ... untouched
      np.testing.assert_array_equal(after[path], before[path], err_msg=path)

  # what the clip is for: every head's logits scale by exactly gamma
  rng = np.random.default_rng(5)
  cq, ckv, x = rng.normal(size=(7, QL)), rng.normal(size=(9, KVL - ROPE)), rng.normal(size=(9, D))
  old = mla_logits(before["mla/q_b_proj"], before["mla/k_b_proj"], before["mla/kv_a_proj"],
                   cq, ckv, x)
  new = mla_logits(after["mla/q_b_proj"], after["mla/k_b_proj"], after["mla/kv_a_proj"],
                   cq, ckv, x)
  np.testing.assert_allclose(new, gamma[:, :, None, None] * old, rtol=2e-6, atol=1e-6)

  # jit-able on plain arrays with explicit names; nnx.update takes the result
  axes = logical_axes_from_state(state)
  pure = jax.jit(lambda p, m: qk_clip(p, m, logical_axes=axes))(nnx.as_pure(state), max_logits)
  np.testing.assert_allclose(np.asarray(flat_by_path(pure)["mla/q_b_proj"]), want_q, rtol=1e-6)
  nnx.update(model, clipped)
  np.testing.assert_array_equal(np.asarray(model.mla["k_b_proj"][...]), after["mla/k_b_proj"])


def test_qk_clip_selects_modules_by_path():
  model = Synthetic([p for p in TABLE if p.startswith(("mla/", "mla_plain/"))])
  state = nnx.state(model, nnx.Param)
  with pytest.raises(ValueError, match="expected one qk_head_dim"):
    qk_clip(state, jnp.full((L, H), 200.0))
  with pytest.raises(ValueError, match="max_logits has shape"):
    qk_clip(state, {("mla",): jnp.full((H,), 200.0)})
  clipped = flat_by_path(nnx.as_pure(qk_clip(
      state, {("mla",): jnp.full((L, H), 50.0), ("mla_plain",): jnp.full((L, H), 200.0)})))
  before = flat_by_path(nnx.as_pure(state))
  np.testing.assert_array_equal(clipped["mla/q_b_proj"], before["mla/q_b_proj"])
  q = np.asarray(before["mla_plain/q_proj"])
  np.testing.assert_allclose(clipped["mla_plain/q_proj"][..., :NOPE], q[..., :NOPE] * 0.5**0.5,
                             rtol=1e-6)
  np.testing.assert_allclose(clipped["mla_plain/q_proj"][..., NOPE:], q[..., NOPE:] * 0.5,
                             rtol=1e-6)
  np.testing.assert_allclose(clipped["mla_plain/k_b_proj"],
                             np.asarray(before["mla_plain/k_b_proj"]) * 0.5**0.5, rtol=1e-6)
