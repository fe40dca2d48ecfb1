"""The GRPO-family objectives against a float64 reference written from the papers, loop by loop,
on a fixed batch: the loss and its gradient with respect to the policy's logprobs (central
finite differences of the reference)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.rl.objectives import (
  Algorithm,
  ISCorrection,
  LossAgg,
  ObjectiveConfig,
  distill_advantages,
  group_advantages,
  k3,
  policy_loss,
  token_weights,
)

G, T, MAX_LEN = 4, 7, 8
LENGTHS = [3, 7, 1, 5, 6, 2, 4, 7, 5, 5, 1, 3, 0]  # 3 groups of 4, then a padding row
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.25, 0.0]]  # group 1: equal


def fixed_batch():
  rng = np.random.default_rng(0)
  n = len(LENGTHS)
  mask = np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]
  old = -rng.uniform(0.05, 3.0, (n, T))
  logp = old + rng.normal(0.0, 0.3, (n, T))  # ratios both inside and outside the clip ranges
  ref = old + rng.normal(0.0, 0.5, (n, T))
  return logp, old, ref, mask


def behaviour():
  """mu's logprobs of the fixed batch: importance ratios pi_old / mu on both sides of the cap
  2 (and of 1/2), so truncation and masking both act."""
  _, old, _, _ = fixed_batch()
  return old + np.random.default_rng(1).normal(0.0, 0.8, old.shape)


# ---- the reference: the papers' formulas, one sequence and one token at a time ------------

def ref_advantages(rewards, normalize_std, eps=1e-6):
  out = []
  for group in rewards:
    mean = sum(group) / len(group)
    if max(group) == min(group):
      out.append([0.0] * len(group))
      continue
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
    out.append([(r - mean) / (std + eps) if normalize_std else r - mean for r in group])
  return [a for group in out for a in group] + [0.0]  # the padding row


def ref_is_weight(cfg: ObjectiveConfig, log_v: float) -> float:
  v = math.exp(log_v)
  if cfg.is_correction == ISCorrection.NONE:
    return 1.0
  if cfg.is_correction == ISCorrection.TIS:
    return min(v, cfg.is_cap)
  return v if 1 / cfg.is_cap <= v <= cfg.is_cap else 0.0


def ref_loss(cfg: ObjectiveConfig, logp, old, ref, mask, behav=None, token_adv=None):
  """The loss written token by token; `behav`: mu's logprobs (tis / mis), `token_adv`:
  per-token advantages (distillation) instead of the group's."""
  adv = ref_advantages(REWARDS, cfg.normalize_std)
  adv_at = (lambda i, t: token_adv[i][t]) if token_adv is not None else (lambda i, t: adv[i])
  seqs = [i for i, n in enumerate(LENGTHS) if n > 0]
  n_seq, n_tok = len(seqs), sum(LENGTHS)
  low, high = 1 - cfg.clip_eps, 1 + cfg.clip_eps_high

  def weight(i):
    if cfg.loss_agg == LossAgg.TOKEN_MEAN:
      return 1.0 / n_tok
    if cfg.loss_agg == LossAgg.SEQUENCE_MEAN:
      return 1.0 / (n_seq * LENGTHS[i])
    return 1.0 / (n_seq * MAX_LEN)

  total = 0.0
  for i in seqs:
    tokens = range(LENGTHS[i])
    for t in tokens:  # k3 KL to the reference (Schulman)
      d = ref[i, t] - logp[i, t]
      total += cfg.kl_coef * weight(i) * (math.exp(d) - d - 1)
    if cfg.algorithm == Algorithm.GSPO:  # sequence ratio: geometric mean of token ratios
      s = math.exp(sum(logp[i, t] - old[i, t] for t in tokens) / LENGTHS[i])
      clipped = min(max(s, low), high)
      a = sum(adv_at(i, t) for t in tokens) / LENGTHS[i]
      w = 1.0 if behav is None else ref_is_weight(
          cfg, sum(old[i, t] - behav[i, t] for t in tokens) / LENGTHS[i])
      total += -min(s * a, clipped * a) * weight(i) * LENGTHS[i] * w
    else:
      for t in tokens:
        r = math.exp(logp[i, t] - old[i, t])
        clipped = min(max(r, low), high)
        w = 1.0 if behav is None else ref_is_weight(cfg, old[i, t] - behav[i, t])
        total += -min(r * adv_at(i, t), clipped * adv_at(i, t)) * weight(i) * w
  return total


def ref_grad(cfg, logp, old, ref, mask, h=1e-6, **kw):
  grad = np.zeros_like(logp)
  for i, t in zip(*np.nonzero(mask)):
    up, down = logp.copy(), logp.copy()
    up[i, t] += h
    down[i, t] -= h
    grad[i, t] = (ref_loss(cfg, up, old, ref, mask, **kw)
                  - ref_loss(cfg, down, old, ref, mask, **kw)) / (2 * h)
  return grad


def ours(cfg, logp, old, ref, mask, behav=None, token_adv=None):
  adv_rows = group_advantages(np.asarray(REWARDS), cfg.normalize_std, cfg.std_eps).reshape(-1)
  adv = np.where(mask, np.append(adv_rows, 0.0)[:, None], 0.0)
  if token_adv is not None:
    adv = np.where(mask, token_adv, 0.0)
  weights = token_weights(mask, cfg.loss_agg, MAX_LEN)

  def loss(lp):
    return policy_loss(cfg, lp, jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv),
                       jnp.asarray(mask), jnp.asarray(weights),
                       None if behav is None else jnp.asarray(behav))

  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
  return float(value), np.asarray(grad), jax.device_get(metrics)


CASES = [ObjectiveConfig(algorithm=a, loss_agg=agg, kl_coef=kl, clip_eps_high=high)
         for a, agg, kl, high in itertools.product(
             [Algorithm.GRPO, Algorithm.DR_GRPO], list(LossAgg), [0.0, 0.05], [None, 0.28])]
CASES += [ObjectiveConfig(algorithm=Algorithm.GSPO, kl_coef=kl, clip_eps=eps, clip_eps_high=high)
          for kl, (eps, high) in itertools.product([0.0, 0.05],
                                                   [(None, None), (0.05, 0.1), (0.2, 0.28)])]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.algorithm}-{c.loss_agg}-kl{c.kl_coef}"
                         f"-clip{c.clip_eps}/{c.clip_eps_high}")
def test_objective_and_gradient_match_the_float64_reference(cfg, x64):
  logp, old, ref, mask = fixed_batch()
  value, grad, metrics = ours(cfg, logp, old, ref, mask)
  assert value == pytest.approx(ref_loss(cfg, logp, old, ref, mask), abs=1e-12, rel=1e-12)
  # central differences with h = 1e-6 on a loss of size ~1: rounding ~2e-16 / h = 2e-10,
  # truncation ~h^2 = 1e-12
  np.testing.assert_allclose(grad, ref_grad(cfg, logp, old, ref, mask), atol=1e-9, rtol=0)
  assert np.all(grad[~mask] == 0)  # padding and prompt positions get no gradient
  assert metrics["tokens"] == sum(LENGTHS) and metrics["sequences"] == len(LENGTHS) - 1


IS_CASES = [ObjectiveConfig(algorithm=a, is_correction=c, loss_agg=agg, kl_coef=0.05)
            for a, c, agg in itertools.product(
                [Algorithm.GRPO, Algorithm.GSPO], [ISCorrection.TIS, ISCorrection.MIS],
                [LossAgg.TOKEN_MEAN, LossAgg.SEQUENCE_MEAN])]


@pytest.mark.parametrize("cfg", IS_CASES, ids=lambda c: f"{c.algorithm}-{c.is_correction}-"
                         f"{c.loss_agg}")
def test_importance_corrected_objectives_match_the_float64_reference(cfg, x64):
  """TIS and MIS (decoupled PPO: the ratio against the trainer's pi_old, each term weighted
  by the truncated or masked pi_old / mu): the loss and its gradient as the reference writes
  them token by token (GSPO: per sequence), and the weights' metrics."""
  logp, old, ref, mask = fixed_batch()
  behav = behaviour()
  value, grad, metrics = ours(cfg, logp, old, ref, mask, behav)
  assert value == pytest.approx(ref_loss(cfg, logp, old, ref, mask, behav), abs=1e-12,
                                rel=1e-12)
  np.testing.assert_allclose(grad, ref_grad(cfg, logp, old, ref, mask, behav=behav),
                             atol=1e-9, rtol=0)
  if cfg.algorithm != Algorithm.GSPO:
    w = [ref_is_weight(cfg, old[i, t] - behav[i, t]) for i, t in zip(*np.nonzero(mask))]
    assert float(metrics["is_weight"]) == pytest.approx(sum(w), rel=1e-12)
    assert float(metrics["is_masked"]) == sum(x == 0 for x in w)
    v = np.exp((old - behav)[mask])
    assert (v > 2).sum() >= 5 and (v < 0.5).sum() >= 5 and ((v > 0.5) & (v < 2)).sum() >= 5


@pytest.mark.parametrize("lam", [1.0, 0.3])
@pytest.mark.parametrize("algorithm", [Algorithm.GRPO, Algorithm.GSPO])
def test_distillation_advantages_and_gradient_match_the_float64_reference(algorithm, lam, x64):
  """On-policy distillation: A_it = lam (log pi_teacher - log mu) + (1 - lam) A_i per token;
  the objective with those advantages and its gradient, against the reference written token
  by token from the definition (mu = pi_old here: the engine's logprobs)."""
  logp, old, ref, mask = fixed_batch()
  teacher = old + np.random.default_rng(2).normal(0.0, 0.7, old.shape)
  cfg = ObjectiveConfig(algorithm=algorithm)
  group = np.append(group_advantages(np.asarray(REWARDS), cfg.normalize_std).reshape(-1), 0.0)
  got = distill_advantages(teacher, old, group[:, None], lam)
  want = [[lam * (teacher[i, t] - old[i, t]) + (1 - lam) * group[i] for t in range(T)]
          for i in range(len(LENGTHS))]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
  base = np.random.default_rng(3).normal(size=(len(LENGTHS), 1))  # --distill-baseline's b_g
  np.testing.assert_allclose(distill_advantages(teacher, old, group[:, None], lam, base),
                             np.asarray(want) - lam * base, rtol=0, atol=1e-14)
  value, grad, _ = ours(cfg, logp, old, ref, mask, token_adv=got)
  assert value == pytest.approx(ref_loss(cfg, logp, old, ref, mask, token_adv=want),
                                abs=1e-12, rel=1e-12)
  np.testing.assert_allclose(grad, ref_grad(cfg, logp, old, ref, mask, token_adv=want),
                             atol=1e-9, rtol=0)


def test_the_fixed_batch_exercises_both_sides_of_the_clip(x64):
  """Some token ratios are clipped and some are not, for each sign of the advantage, so the
  gradient comparison above covers both branches of the min."""
  logp, old, _, mask = fixed_batch()
  ratio = np.exp(logp - old)[mask]
  assert (ratio > 1.2).sum() >= 5 and (ratio < 0.8).sum() >= 5
  assert ((ratio > 0.8) & (ratio < 1.2)).sum() >= 5
  cfg = ObjectiveConfig()
  _, _, metrics = ours(cfg, *fixed_batch())
  assert 0 < metrics["clipped"] < metrics["tokens"]


def test_defaults_follow_the_papers():
  grpo, dr, gspo = (ObjectiveConfig(algorithm=a) for a in Algorithm)
  assert (grpo.loss_agg, grpo.clip_eps, grpo.clip_eps_high, grpo.normalize_std) == (
      LossAgg.SEQUENCE_MEAN, 0.2, 0.2, True)
  assert (dr.loss_agg, dr.normalize_std) == (LossAgg.FIXED_LENGTH_SUM, False)
  assert (gspo.loss_agg, gspo.clip_eps, gspo.clip_eps_high) == (LossAgg.SEQUENCE_MEAN, 3e-4, 4e-4)
  assert ObjectiveConfig(clip_eps=0.1).clip_eps_high == 0.1  # an explicit eps alone: symmetric
  assert ObjectiveConfig(clip_eps_high=0.28).clip_eps == 0.2  # DAPO's clip-higher
  with pytest.raises(ValueError):
    ObjectiveConfig(clip_eps=1.5)
  with pytest.raises(ValueError):
    ObjectiveConfig(kl_coef=-1)


def test_group_advantages():
  r = np.array([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3], [0.1 * 3, 0.3, 0.3, 0.3]])
  a = group_advantages(r, normalize_std=True)
  x = 0.5 / (np.sqrt(1 / 3) + 1e-6)  # sample std of {1, 0, 0, 1}: sqrt(1/3)
  np.testing.assert_allclose(a[0], [x, -x, -x, x], rtol=1e-15)
  assert np.all(a[1] == 0.0)  # all rewards equal: no signal, exactly
  assert np.all(np.abs(a[2]) < 1e-9)  # equal up to rounding: std ~ 1e-17, eps keeps it tiny
  np.testing.assert_array_equal(group_advantages(r, normalize_std=False)[0], [0.5, -0.5, -0.5, 0.5])


def test_token_weights():
  mask = np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]
  tok = token_weights(mask, LossAgg.TOKEN_MEAN, MAX_LEN)
  seq = token_weights(mask, LossAgg.SEQUENCE_MEAN, MAX_LEN)
  fixed = token_weights(mask, LossAgg.FIXED_LENGTH_SUM, MAX_LEN)
  assert tok.sum() == pytest.approx(1.0)
  n = len(LENGTHS) - 1
  np.testing.assert_allclose(seq.sum(1), [1.0 / n] * n + [0.0])
  np.testing.assert_allclose(fixed.sum(1), np.asarray(LENGTHS) / (MAX_LEN * n))
  for w in (tok, seq, fixed):
    assert np.all(w[~mask] == 0)
  assert np.all(token_weights(np.zeros((2, T), bool), LossAgg.SEQUENCE_MEAN, MAX_LEN) == 0)


def test_k3_is_a_nonnegative_kl_estimate(x64):
  rng = np.random.default_rng(1)
  p = jax.nn.log_softmax(jnp.asarray(rng.normal(size=50)))
  q = jax.nn.log_softmax(jnp.asarray(rng.normal(size=50)))
  assert np.all(np.asarray(k3(p, q)) >= 0) and float(jnp.max(jnp.abs(k3(p, p)))) == 0.0
  # its expectation under q is KL(q || p)
  kl = float(jnp.sum(jnp.exp(q) * (q - p)))
  assert float(jnp.sum(jnp.exp(q) * k3(p, q))) == pytest.approx(kl, rel=1e-12)
  # clamped: a reference far more confident than the policy stays finite
  assert np.isfinite(float(k3(jnp.float32(0.0), jnp.float32(-500.0))))


def test_zero_advantages_and_overflowing_ratios_stay_finite():
  """float32: a huge log-ratio on a token whose advantage is 0 (inf * 0 would be NaN)."""
  logp = jnp.asarray([[50.0, -60.0, 0.0]], jnp.float32)
  zeros = jnp.zeros((1, 3), jnp.float32)
  mask = jnp.asarray([[True, True, False]])
  for algo in Algorithm:
    cfg = ObjectiveConfig(algorithm=algo, kl_coef=0.1)
    fn = lambda lp, cfg=cfg: policy_loss(cfg, lp, zeros, zeros, zeros, mask,
                                         jnp.full((1, 3), 0.5))
    (value, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    assert all(np.isfinite(float(v)) for v in metrics.values())
