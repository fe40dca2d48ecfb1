"""Policy-gradient objectives of the GRPO family, each as its paper defines it (docs/rl.md).

A step's rollouts are N completions o_i of the prompts, G per prompt (a group), each with a
reward r_i. For completion i and its token t (1 <= t <= |o_i|):

    log rho_it = log pi_theta(o_it | q, o_i<t) - log pi_old(o_it | q, o_i<t)
    rho_it = exp(log rho_it)     pi_old: the rollout policy, its logprobs as the engine drew

Advantages, one per completion (`group_advantages`):
    GRPO (Shao et al. 2024, DeepSeekMath)   A_i = (r_i - mean_g r) / (std_g r + eps)
    Dr. GRPO (Liu et al. 2025)              A_i = r_i - mean_g r        (no std normalisation)
std_g is the group's sample standard deviation (G - 1 in the denominator). A group whose
rewards are all equal has A_i = 0 exactly: it carries no policy-gradient signal.

Per-token PPO-clip (GRPO, Dr. GRPO), with DAPO's clip-higher (Yu et al. 2025) as separate low
and high ranges (eps_high = eps_low: the symmetric PPO clip):
    l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) + beta k3_it
GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios,
clipped as a whole:
    s_i = exp(1/|o_i| sum_t log rho_it)
    l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
KL to the reference policy, Schulman's k3 estimator on the sampled tokens (unbiased, >= 0):
    k3_it = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1

Aggregation over tokens (`LossAgg`), as the weights w_it of `token_weights`:
    token-mean        w = 1 / sum_i |o_i|        every token counts the same (DAPO)
    sequence-mean     w = 1 / (N |o_i|)          mean over a sequence, then over sequences
                                                (GRPO as written)
    fixed-length-sum  w = 1 / (N L)              L = the generation budget, a constant: no
                                                length normalisation (Dr. GRPO)
    loss = sum_it w_it l_it ; for GSPO sum_i W_i l_i + beta sum_it w_it k3_it, W_i = sum_t w_it

Rollout importance sampling (`--is-correction`; decoupled PPO, three policies). The tokens were
drawn by a behaviour policy mu (the engine's logprobs at sampling: an older policy version
for a partial rollout continued across updates, and the engine's numerics); pi_old is the
trainer's policy recomputed at the update's start, and the ratio rho_it = pi_theta / pi_old.
Each token's term is weighted by w_it, from v_it = pi_old / mu of that token (no gradient):
    none   w = 1, and pi_old is mu itself (no recomputation): the plain objective above
    tis    w = min(v, C)                            truncated importance sampling
    mis    w = v if 1/C <= v <= C, else 0           masked importance sampling
with C = `--is-cap`. GSPO weights its sequence term by the sequence's v_i = exp(1/|o_i| sum_t
log v_it), truncated or masked the same way.

On-policy distillation (`distill_advantages`): the per-token advantage
    A_it = lam (log pi_teacher(o_it) - log mu(o_it)) + (1 - lam) A_i
(reverse KL to the teacher on the student's own samples, mixed with the group reward
advantage by lam = `--distill-weight`). With `--distill-baseline` the teacher - mu term is
taken less its mean b_g over the sampled tokens of the trajectory's group: a baseline (the
expected gradient is unchanged, since E[b grad log mu] = 0). Without it, a token the policy
rarely samples is pushed by the advantages of the tokens sampled instead (the normaliser's
term), which in expectation its own rare samples cancel but which, with few samples a step
and Adam's per-parameter normalisation, drifts the policy away from the teacher.

The weights are computed on the host over the whole update batch, so a loss summed over
micro-batches is the loss of the batch. Log-ratios are clamped to [-20, 20] before exp: a
ratio of e^20 is far outside any clip range, and the clamp keeps float32 from overflowing
(inf * 0 for a zero advantage would be NaN); it changes nothing inside that range.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

LOG_RATIO_CLAMP = 20.0


class Algorithm(enum.StrEnum):
  GRPO = "grpo"
  DR_GRPO = "dr-grpo"
  GSPO = "gspo"


class LossAgg(enum.StrEnum):
  TOKEN_MEAN = "token-mean"
  SEQUENCE_MEAN = "sequence-mean"
  FIXED_LENGTH_SUM = "fixed-length-sum"


class ISCorrection(enum.StrEnum):
  NONE = "none"
  TIS = "tis"
  MIS = "mis"


# what each algorithm's paper uses when --loss-agg / --clip-eps are not given
DEFAULT_AGG = {Algorithm.GRPO: LossAgg.SEQUENCE_MEAN, Algorithm.DR_GRPO: LossAgg.FIXED_LENGTH_SUM,
               Algorithm.GSPO: LossAgg.SEQUENCE_MEAN}
# GSPO clips a sequence-level ratio, which moves far less than a token's: its paper's ranges
DEFAULT_CLIP = {Algorithm.GRPO: (0.2, 0.2), Algorithm.DR_GRPO: (0.2, 0.2),
                Algorithm.GSPO: (3e-4, 4e-4)}


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """The policy-gradient loss (hashable: it keys the train step's compile cache).

  Attributes:
    algorithm: grpo | dr-grpo | gspo.
    loss_agg: how per-token terms are averaged (None: the algorithm's own, DEFAULT_AGG).
    clip_eps: eps_low of the ratio clip (None: the algorithm's own, DEFAULT_CLIP).
    clip_eps_high: eps_high (None: clip_eps, the symmetric clip; DAPO's clip-higher: 0.28).
    kl_coef: beta of the k3 KL term to the reference policy (0: no KL term).
    std_eps: eps of GRPO's std normalisation.
    is_correction: none | tis | mis, the rollout importance weights (module docstring).
    is_cap: C of tis / mis.
  """
  algorithm: Algorithm = Algorithm.GRPO
  loss_agg: LossAgg | None = None
  clip_eps: float | None = None
  clip_eps_high: float | None = None
  kl_coef: float = 0.0
  std_eps: float = 1e-6
  is_correction: ISCorrection = ISCorrection.NONE
  is_cap: float = 2.0

  def __post_init__(self):
    object.__setattr__(self, "algorithm", Algorithm(self.algorithm))
    object.__setattr__(self, "is_correction", ISCorrection(self.is_correction))
    if not self.is_cap > 1:
      raise ValueError(f"the importance-weight cap must be > 1, got {self.is_cap}")
    if self.loss_agg is None:
      object.__setattr__(self, "loss_agg", DEFAULT_AGG[self.algorithm])
    object.__setattr__(self, "loss_agg", LossAgg(self.loss_agg))
    low, high = DEFAULT_CLIP[self.algorithm]
    if self.clip_eps_high is None:  # an explicit eps_low alone is the symmetric clip
      object.__setattr__(self, "clip_eps_high", high if self.clip_eps is None else self.clip_eps)
    if self.clip_eps is None:
      object.__setattr__(self, "clip_eps", low)
    if not 0 < self.clip_eps < 1 or not self.clip_eps_high > 0:
      raise ValueError(f"clip ranges must be 0 < eps_low < 1 and eps_high > 0, got "
                       f"{self.clip_eps}, {self.clip_eps_high}")
    if self.kl_coef < 0:
      raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

  @property
  def normalize_std(self) -> bool:
    return self.algorithm != Algorithm.DR_GRPO


# ---- host side: advantages and weights (numpy, float64) ------------------------------------

def group_advantages(rewards_ng: np.ndarray, normalize_std: bool, eps: float = 1e-6
                     ) -> np.ndarray:
  """[groups, G] rewards -> [groups, G] advantages (module docstring); 0 for a group whose
  rewards are all equal."""
  r = np.asarray(rewards_ng, np.float64)
  centered = r - r.mean(axis=1, keepdims=True)
  if normalize_std:
    std = r.std(axis=1, ddof=1, keepdims=True) if r.shape[1] > 1 else np.zeros_like(r[:, :1])
    centered = centered / (std + eps)
  uniform = (r.max(axis=1) == r.min(axis=1))[:, None]
  return np.where(uniform, 0.0, centered)


def token_weights(mask_nt: np.ndarray, agg: LossAgg, max_len: int) -> np.ndarray:
  """[N, T] weights w_it of the aggregation over the tokens `mask_nt` marks (rows with none
  weigh 0 and do not count in N)."""
  mask = np.asarray(mask_nt, np.float64)
  lengths = mask.sum(axis=1, keepdims=True)
  n_seq = max(int((lengths > 0).sum()), 1)
  if agg == LossAgg.TOKEN_MEAN:
    return mask / max(mask.sum(), 1.0)
  if agg == LossAgg.SEQUENCE_MEAN:
    return mask / (np.maximum(lengths, 1.0) * n_seq)
  if agg == LossAgg.FIXED_LENGTH_SUM:
    return mask / (float(max_len) * n_seq)
  raise ValueError(f"unknown loss aggregation {agg!r}")


def distill_advantages(teacher_logp: np.ndarray, student_logp: np.ndarray,
                       group_adv: np.ndarray, weight: float, baseline=0.0) -> np.ndarray:
  """Per-token advantages of on-policy distillation (module docstring): lam (teacher -
  student - baseline) + (1 - lam) A_i, arrays [..., T] (group_adv and baseline broadcast)."""
  t, s = np.asarray(teacher_logp, np.float64), np.asarray(student_logp, np.float64)
  return (weight * (t - s - np.asarray(baseline, np.float64))
          + (1.0 - weight) * np.asarray(group_adv, np.float64))


def k3(log_p: np.ndarray | jax.Array, log_q: np.ndarray | jax.Array, xp=jnp):
  """Schulman's k3 estimate of KL(q || p) per token from samples of q: exp(d) - d - 1 with
  d = log p - log q, clamped to +-LOG_RATIO_CLAMP. Computed as expm1(d) - d: in exp(d) - d - 1
  the rounding of exp(d) near 1 swamps the d^2 / 2 of a small d (negative values in float32)."""
  d = xp.clip(log_p - log_q, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return xp.expm1(d) - d


# ---- device side: the loss ---------------------------------------------------------------

def is_weights(cfg: ObjectiveConfig, log_v: jax.Array) -> jax.Array:
  """w of the log importance ratios log v = log pi_old - log mu (module docstring)."""
  v = jnp.exp(jnp.clip(log_v, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  if cfg.is_correction == ISCorrection.TIS:
    return jnp.minimum(v, cfg.is_cap)
  inside = (v <= cfg.is_cap) & (v >= 1.0 / cfg.is_cap)
  return jnp.where(inside, v, jnp.zeros((), v.dtype))


def policy_loss(cfg: ObjectiveConfig, logp: jax.Array, old_logp: jax.Array,
                ref_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                weights: jax.Array, behav_logp: jax.Array | None = None
                ) -> tuple[jax.Array, dict]:
  """(loss, metric sums) of [..., T] per-token arrays (leading dims: rows). `logp` is
  log pi_theta of the sampled tokens (what is differentiated), `advantages` A at each token
  (the row's A_i, or per-token advantages), `mask` the completion tokens, `weights`
  token_weights'; `behav_logp` mu's logprobs, read under tis / mis (old_logp then being the
  trainer's pi_old). Metric sums over the masked tokens: clipped (tokens, or GSPO's
  sequences, whose clip was active), kl_ref (k3 to the reference), mismatch_k3 (k3 of
  pi_theta against pi_old: the rollout / trainer mismatch when theta is the rollout's),
  max_abs_log_ratio, is_weight (w per token), is_masked (tokens MIS left out), tokens,
  sequences."""
  mask = mask.astype(bool)
  zero = jnp.zeros((), logp.dtype)
  log_ratio = jnp.where(mask, jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), zero)
  correct = cfg.is_correction != ISCorrection.NONE
  log_v = jnp.where(mask, old_logp - behav_logp, zero) if correct else None
  low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high
  kl = jnp.where(mask, k3(ref_logp, logp), zero)
  lengths = jnp.sum(mask, axis=-1)
  has = lengths > 0
  if cfg.algorithm == Algorithm.GSPO:
    n = jnp.maximum(lengths, 1).astype(logp.dtype)
    s = jnp.exp(jnp.sum(log_ratio, axis=-1) / n)                   # [rows]
    adv = jnp.sum(jnp.where(mask, advantages, zero), axis=-1) / n  # the row's A_i
    unclipped, clipped = s * adv, jnp.clip(s, low, high) * adv
    seq_loss = -jnp.minimum(unclipped, clipped)
    w = is_weights(cfg, jnp.sum(log_v, axis=-1) / n) if correct else jnp.ones_like(s)
    row_w = jnp.sum(weights, axis=-1)
    pg = jnp.sum(row_w * jax.lax.stop_gradient(w) * seq_loss)
    n_clipped = jnp.sum((clipped < unclipped) & has)
    w_tok = jnp.where(mask, w[..., None], zero)
  else:
    ratio = jnp.exp(log_ratio)
    unclipped, clipped = ratio * advantages, jnp.clip(ratio, low, high) * advantages
    w = is_weights(cfg, log_v) if correct else jnp.ones_like(logp)
    pg = jnp.sum(weights * jax.lax.stop_gradient(w) * -jnp.minimum(unclipped, clipped))
    n_clipped = jnp.sum((clipped < unclipped) & mask)
    w_tok = jnp.where(mask, w, zero)
  loss = pg + cfg.kl_coef * jnp.sum(weights * kl) if cfg.kl_coef else pg
  raw = jnp.where(mask, logp - old_logp, zero)
  metrics = {
      "clipped": n_clipped.astype(logp.dtype),
      "kl_ref": jnp.sum(kl),
      "mismatch_k3": jnp.sum(jnp.where(mask, k3(logp, old_logp), zero)),
      "max_abs_log_ratio": jnp.max(jnp.abs(raw)),
      "tokens": jnp.sum(mask).astype(logp.dtype),
      "sequences": jnp.sum(has).astype(logp.dtype),
      "pg_loss": pg,
      "is_weight": jnp.sum(w_tok),
      "is_masked": jnp.sum(mask & (w_tok == 0)).astype(logp.dtype) if correct else zero,
  }
  return loss, metrics
