"""The KDA layer against a numpy transcription of docs/model.md#kda-layer (projections, causal conv,
gates, l2norm, the recurrence, gated output norm), the Kimi-Linear variant against transformers'
KimiLinearDeltaAttention, and its decode-state and packed-sequence behaviour."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.model.kda import KDA
from tests.k3jax.model.helpers import F64, kimi_linear_cfg, np64, randomize, tiny_cfg


def np_sigmoid(a):
  return 1 / (1 + np.exp(-a))


def np_kda_layer(m: KDA, cfg, x, seg=None):
  p = lambda w: np64(w[...])
  B, T, _ = x.shape
  H, K = cfg.kda_num_heads, cfg.kda_head_dim
  if seg is None:
    seg = np.zeros((B, T), int)

  def conv(u, w):  # u [B,T,H,K], w [H,K,taps]: y_t = sum_j w_j u_{t-(taps-1)+j}, same segment
    taps = w.shape[-1]
    y = np.zeros_like(u)
    for t in range(T):
      for j in range(taps):
        s = t - (taps - 1) + j
        if s >= 0:
          y[:, t] += np.where((seg[:, s] == seg[:, t])[:, None, None], u[:, s] * w[..., j], 0)
    return y * np_sigmoid(y)  # silu

  q = conv(np.einsum("btd,dhk->bthk", x, p(m.q_proj.kernel)), p(m.q_conv))
  k = conv(np.einsum("btd,dhk->bthk", x, p(m.k_proj.kernel)), p(m.k_conv))
  v = conv(np.einsum("btd,dhk->bthk", x, p(m.v_proj.kernel)), p(m.v_conv))
  q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
  k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
  f = np.einsum("btr,rhk->bthk", x @ p(m.f_a_proj.kernel), p(m.f_b_proj.kernel)) + p(m.dt_bias)
  a = np.exp(p(m.A_log))[:, None]
  if cfg.kda_gate == "lower_bound":
    g = cfg.gate_lower_bound * np_sigmoid(a * f)
  else:
    g = -a * np.log1p(np.exp(f))
  beta = np_sigmoid(np.einsum("btd,dh->bth", x, p(m.b_proj.kernel)))
  o = np.zeros_like(v)
  for b in range(B):
    S = np.zeros((H, K, K))
    for t in range(T):
      if t and seg[b, t] != seg[b, t - 1]:
        S = np.zeros((H, K, K))
      for h in range(H):
        S[h] = S[h] * np.exp(g[b, t, h])[:, None]
        S[h] = S[h] + beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h] - k[b, t, h] @ S[h])
        o[b, t, h] = S[h].T @ q[b, t, h] / np.sqrt(K)
  if cfg.kda_full_rank_output_gate:
    gate = np.einsum("btd,dhv->bthv", x, p(m.g_proj.kernel))
  else:
    gate = np.einsum("btr,rhv->bthv", x @ p(m.g_a_proj.kernel), p(m.g_b_proj.kernel))
  o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + cfg.rms_norm_eps) * p(m.o_norm)
  o = o * np_sigmoid(gate)
  return np.einsum("bthv,hvd->btd", o, p(m.o_proj.kernel))


def _layer(cfg, seed=0):
  m = randomize(KDA(cfg, F64, rngs=nnx.Rngs(seed)), seed)
  rng = np.random.default_rng(seed + 50)
  m.A_log.set_value(jnp.asarray(rng.uniform(-1, 1.5, cfg.kda_num_heads), m.A_log[...].dtype))
  m.dt_bias.set_value(jnp.asarray(rng.uniform(-4, 1, m.dt_bias.shape), m.dt_bias[...].dtype))
  return m


@pytest.mark.parametrize("variant", ["k3", "kimi_linear"])
@pytest.mark.parametrize("segments", [False, True])
def test_kda_layer_formula(variant, segments, x64):
  cfg = (tiny_cfg if variant == "k3" else kimi_linear_cfg)()
  m = _layer(cfg)
  x = np.random.default_rng(1).standard_normal((2, 13, cfg.hidden_size))
  seg = np.array([[1] * 6 + [2] * 7, [3] * 2 + [4] * 11]) if segments else None
  got, _ = m(jnp.asarray(x), segment_ids=None if seg is None else jnp.asarray(seg))
  np.testing.assert_allclose(np64(got), np_kda_layer(m, cfg, x, seg), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("variant", ["k3", "kimi_linear"])
def test_decode_state_continues_the_sequence(variant, x64):
  """Running T tokens, or T1 (chunked op) then one token (fused step) then the rest (chunked,
  with the state), is the same computation: float64, equal to summation order (1e-12). The
  conv tails are exactly the last taps-1 projected inputs."""
  cfg = (tiny_cfg if variant == "k3" else kimi_linear_cfg)()
  m = _layer(cfg)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 40, 32)))
  full, state_full = m(x)
  first, state = m(x[:, :23])
  step, state = m(x[:, 23:24], state=state)
  rest, state = m(x[:, 24:], state=state)
  np.testing.assert_allclose(np64(jnp.concatenate([first, step, rest], 1)), np64(full),
                             atol=1e-12, rtol=0)
  np.testing.assert_allclose(np64(state.recurrent), np64(state_full.recurrent), atol=1e-12)
  np.testing.assert_array_equal(np64(state.conv_k), np64(m.k_proj(x[:, 24:])[:, -3:]))
  np.testing.assert_array_equal(np64(state_full.conv_v), np64(m.v_proj(x)[:, -3:]))


def test_left_padding_is_not_absorbed(x64):
  """A row of pads (token_mask False) then a sequence computes what the sequence computes
  alone, and the state stays exactly zero through the pads."""
  cfg = tiny_cfg()
  m = _layer(cfg)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 20, 32)))
  alone, _ = m(x[:, 7:])
  mask = jnp.arange(20)[None] >= 7
  junk = jnp.concatenate([x[:, :7] * 100, x[:, 7:]], 1)  # the pads' content must not matter
  padded, _ = m(junk, token_mask=mask)
  _, s_pads_only = m(x[:, :7] * 100, token_mask=mask[:, :7])
  np.testing.assert_allclose(np64(padded[:, 7:]), np64(alone), atol=1e-12, rtol=0)
  assert not np.any(np64(s_pads_only.recurrent)) and not np.any(np64(s_pads_only.conv_q))


def test_kimi_linear_kda_matches_transformers(x64):
  torch = pytest.importorskip("torch")
  from transformers import KimiLinearConfig
  from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
  cfg = kimi_linear_cfg()
  m = _layer(cfg, seed=5)
  hf_cfg = KimiLinearConfig(hidden_size=32, num_hidden_layers=5, hidden_act="silu",
                            linear_attn_config={"head_dim": 8, "num_heads": 2,
                                                "short_conv_kernel_size": 4,
                                                "full_attn_layers": [4, 5],
                                                "kda_layers": [1, 2, 3]})
  ref = KimiLinearDeltaAttention(hf_cfg, layer_idx=0).double()
  t = lambda a: torch.from_numpy(np.array(np64(a[...])))
  lin = lambda w: t(w).reshape(w.shape[0], -1).T  # [in, H, K] -> torch [H*K, in]
  with torch.no_grad():
    for name in ("q_proj", "k_proj", "v_proj"):
      getattr(ref, name).weight.copy_(lin(getattr(m, name).kernel))
    ref.conv1d.weight.copy_(torch.cat([t(w).reshape(16, 1, 4) for w in (m.q_conv, m.k_conv,
                                                                       m.v_conv)]))
    ref.forget_gate.f_a_proj.weight.copy_(lin(m.f_a_proj.kernel))
    ref.forget_gate.f_b_proj.weight.copy_(lin(m.f_b_proj.kernel))
    ref.forget_gate.dt_bias.copy_(t(m.dt_bias).reshape(-1))
    ref.forget_gate.A_log.copy_(t(m.A_log).reshape(1, 1, 2, 1))
    ref.b_proj.weight.copy_(lin(m.b_proj.kernel))
    ref.g_a_proj.weight.copy_(lin(m.g_a_proj.kernel))
    ref.g_b_proj.weight.copy_(lin(m.g_b_proj.kernel))
    ref.o_norm.weight.copy_(t(m.o_norm))
    ref.o_proj.weight.copy_(t(m.o_proj.kernel).reshape(16, 32).T)
  x = np.random.default_rng(6).standard_normal((2, 70, 32))
  want = ref(torch.from_numpy(x)).detach().numpy()
  # transformers' chunked KDA runs in fp32 inside a float64 module: fp32-level agreement
  np.testing.assert_allclose(np64(m(jnp.asarray(x))[0]), want, atol=1e-5)
