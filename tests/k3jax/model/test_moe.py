"""Router, routed experts and LatentMoE against a per-token numpy loop
(docs/model.md#router-and-latentmoe), and the Kimi-Linear MoE against transformers' KimiLinearMoE on
the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.execution import Execution
from k3jax.model.moe import MoE
from tests import numerics
from tests.k3jax.model.helpers import F64, kimi_linear_cfg, np64, randomize, tiny_cfg


def np_silu(a):
  return a / (1 + np.exp(-a))


def np_moe(moe: MoE, cfg, x, keep=None):
  """Per-token, per-expert transcription of docs/model.md#router-and-latentmoe. keep [N, k] (bool,
  slot order of the top-k): pairs to compute; the others are dropped (capacity factor), weights
  unchanged."""
  x = np64(x).reshape(-1, cfg.hidden_size)
  w_r, bias = np64(moe.gate.kernel[...]), np64(moe.gate.bias[...])
  s = 1 / (1 + np.exp(-(x @ w_r)))
  k = cfg.num_experts_per_token
  w1, w3, w2 = (np64(w[...]) for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2))
  latent = cfg.latent_size is not None
  z = x @ np64(moe.routed_down.kernel[...]) if latent else x
  out = np.zeros_like(x)
  for n in range(x.shape[0]):
    chosen = np.argsort(-(s[n] + bias), kind="stable")[:k]
    p = s[n, chosen]
    if cfg.moe_renormalize:
      p = p / (p.sum() + 1e-20)
    p = p * cfg.routed_scaling_factor
    u = np.zeros(z.shape[1])
    for j, (e, pe) in enumerate(zip(chosen, p)):
      if keep is not None and not keep[n, j]:
        continue
      a, b = z[n] @ w1[e], z[n] @ w3[e]
      act = (4 * np.tanh(a / 4) / (1 + np.exp(-a)) * 25 * np.tanh(b / 25)
             if cfg.hidden_act == "situ" else np_silu(a) * b)
      u = u + pe * (act @ w2[e])
    if latent:
      g = np64(moe.latent_norm.weight[...])
      u = g * u / np.sqrt(np.mean(u * u) + cfg.rms_norm_eps)
      u = u @ np64(moe.routed_up.kernel[...])
    sh = moe.shared_experts
    a, b = x[n] @ np64(sh.gate_proj.kernel[...]), x[n] @ np64(sh.up_proj.kernel[...])
    act = (4 * np.tanh(a / 4) / (1 + np.exp(-a)) * 25 * np.tanh(b / 25)
           if cfg.hidden_act == "situ" else np_silu(a) * b)
    out[n] = u + act @ np64(sh.down_proj.kernel[...])
  return out


def _moe(cfg, seed=0, ex=Execution()):
  moe = randomize(MoE(cfg, ex, rngs=nnx.Rngs(seed)), seed)
  rng = np.random.default_rng(seed + 100)
  moe.gate.bias.set_value(jnp.asarray(rng.uniform(-0.1, 0.1, cfg.num_experts), jnp.float32))
  return moe


@pytest.mark.parametrize("variant", ["k3_latent", "kimi_linear"])
def test_moe_matches_per_token_loop(variant, x64):
  cfg = (tiny_cfg if variant == "k3_latent" else kimi_linear_cfg)()
  moe = _moe(cfg, ex=F64)
  x = np.random.default_rng(1).standard_normal((2, 7, cfg.hidden_size))
  y, routing = moe(jnp.asarray(x))
  np.testing.assert_allclose(np64(y).reshape(-1, cfg.hidden_size), np_moe(moe, cfg, x),
                             atol=1e-10, rtol=1e-10)
  assert routing.experts_nk.shape == (14, cfg.num_experts_per_token)


def test_selection_uses_bias_but_weights_do_not():
  cfg = tiny_cfg()
  moe = _moe(cfg)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 5, 32)), jnp.float32)
  big = jnp.zeros(cfg.num_experts).at[jnp.array([1, 5, 6])].set(10.0)
  moe.gate.bias.set_value(big)
  _, routing = moe(x)
  assert (np.sort(np.asarray(routing.experts_nk), -1) == [1, 5, 6]).all()
  s = np64(routing.scores_ne)[np.arange(5)[:, None], np.asarray(routing.experts_nk)]
  # the weights are the chosen float32 scores over their float32 sum (x 1.0): 2 roundings in
  # the sum of 3 positive terms, 1 in the divide, <= 3 u relative of the float64 quotient
  # (u = 2^-24) on any machine; 1e-6 is 16 u
  np.testing.assert_allclose(np.asarray(routing.weights_nk), s / s.sum(-1, keepdims=True),
                             rtol=1e-6, atol=0)


def test_dropless_when_every_token_picks_the_same_experts():
  """No capacity: 64 tokens all routed to the same 3 experts are all computed."""
  cfg = tiny_cfg()
  moe = _moe(cfg)
  moe.gate.bias.set_value(jnp.zeros(cfg.num_experts).at[:3].set(100.0))
  x = np.random.default_rng(3).standard_normal((2, 32, 32)).astype(np.float32)
  y, _ = moe(jnp.asarray(x))
  with jax.enable_x64(True):
    want = np_moe(moe, cfg, x)
  # float32 vs the float64 loop: docs/correctness.md's 1e-5 of the output's scale
  # (tests/numerics.py; the outputs reach 2.2 here, the error measured 3.6 u of that scale,
  # u = 2^-24)
  numerics.assert_close("moe", np64(y).reshape(-1, 32), want)


def test_gradients_reach_every_selected_expert():
  cfg = tiny_cfg()
  moe = _moe(cfg)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 16, 32)), jnp.float32)

  def loss(m):
    return jnp.sum(m(x)[0] ** 2)

  grads = nnx.grad(loss)(moe)
  _, routing = moe(x)
  used = np.unique(np.asarray(routing.experts_nk))
  g1 = np.abs(np.asarray(grads.experts.w1[...])).sum((1, 2))
  assert (g1[used] > 0).all() and (g1[np.setdiff1d(np.arange(8), used)] == 0).all()
  assert not hasattr(grads.gate, "bias") or np.all(np.asarray(grads.gate.bias[...]) == 0)


def test_kimi_linear_moe_matches_transformers(x64):
  torch = pytest.importorskip("torch")
  from transformers import KimiLinearConfig
  from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
  cfg = kimi_linear_cfg()
  moe = _moe(cfg, seed=7, ex=F64)
  hf_cfg = KimiLinearConfig(hidden_size=32, moe_intermediate_size=16, num_local_experts=8,
                            num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
                            hidden_act="silu")
  ref = KimiLinearMoE(hf_cfg).double()
  t = lambda a: torch.from_numpy(np64(a))
  with torch.no_grad():
    ref.gate.weight.copy_(t(moe.gate.kernel[...]).T)
    ref.gate.e_score_correction_bias.copy_(t(moe.gate.bias[...]))
    ref.experts.gate_up_proj.copy_(torch.cat([t(moe.experts.w1[...]).transpose(1, 2),
                                              t(moe.experts.w3[...]).transpose(1, 2)], 1))
    ref.experts.down_proj.copy_(t(moe.experts.w2[...]).transpose(1, 2))
    for name in ("gate_proj", "up_proj", "down_proj"):
      getattr(ref.shared_experts, name).weight.copy_(
          t(getattr(moe.shared_experts, name).kernel[...]).T)
  x = np.random.default_rng(8).standard_normal((2, 9, 32))
  want = ref(torch.from_numpy(x)).detach().numpy()
  got = np64(moe(jnp.asarray(x))[0])
  # transformers' router runs in fp32 even in a float64 module: fp32-level agreement
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_dropless_reports_no_dropped_pairs():
  cfg = tiny_cfg()
  _, routing = _moe(cfg)(jnp.ones((1, 4, 32)))
  assert routing.dropped_pairs.dtype == jnp.int32 and int(routing.dropped_pairs) == 0


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_factor_on_one_device(factor, x64):
  """cap = ceil(c * k * N / E) pairs per expert, the earliest tokens kept; dropped pairs add
  nothing and are counted. Against the per-token loop with numpy's own keep mask."""
  cfg = tiny_cfg()
  moe = _moe(cfg, seed=9, ex=F64.replace(moe_capacity_factor=factor))
  moe.gate.bias.set_value(jnp.zeros(cfg.num_experts).at[:2].set(0.3))  # experts 0, 1 overflow
  x = np.random.default_rng(10).standard_normal((2, 11, 32))
  y, routing = moe(jnp.asarray(x))
  n, k, e = 22, cfg.num_experts_per_token, cfg.num_experts
  cap = int(np.ceil(factor * k * n / e))
  keep, seen = np.zeros((n, k), bool), np.zeros(e, int)
  for t, chosen in enumerate(np.asarray(routing.experts_nk)):
    for j, ex in enumerate(chosen):
      keep[t, j], seen[ex] = seen[ex] < cap, seen[ex] + 1
  assert (~keep).sum() > 0
  assert int(routing.dropped_pairs) == (~keep).sum()
  np.testing.assert_allclose(np64(y).reshape(n, -1), np_moe(moe, cfg, x, keep=keep),
                             atol=1e-10, rtol=0)
