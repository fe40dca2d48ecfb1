"""Gated MLA (NoPE) against a numpy transcription of docs/model.md#gated-mla with causal and segment
masks, and the Kimi-Linear variant (plain q_proj, no gate) against transformers'
KimiLinearAttention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.model.mla import MLA
from tests.k3jax.model.helpers import F64, kimi_linear_cfg, np64, randomize, tiny_cfg


def np_rms(x, g, eps):
  return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def np_mla(m: MLA, cfg, x, seg=None):
  p = lambda mod: np64(mod.kernel[...])
  B, T, _ = x.shape
  if cfg.q_lora_rank is not None:
    qa = np_rms(x @ p(m.q_a_proj), np64(m.q_a_norm.weight[...]), 1e-6)
    q = np.einsum("btr,rhk->bthk", qa, p(m.q_b_proj))
  else:
    q = np.einsum("btd,dhk->bthk", x, p(m.q_proj))
  ckv = x @ p(m.kv_a_proj)
  c = np_rms(ckv[..., : cfg.kv_lora_rank], np64(m.kv_a_norm.weight[...]), 1e-6)
  k_rot = ckv[..., cfg.kv_lora_rank:]
  k_nope = np.einsum("btc,chk->bthk", c, p(m.k_b_proj))
  v = np.einsum("btc,chk->bthk", c, p(m.v_b_proj))
  H = cfg.mla_num_heads
  k = np.concatenate([k_nope, np.broadcast_to(k_rot[:, :, None], (B, T, H, k_rot.shape[-1]))], -1)
  s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(cfg.qk_head_dim)
  mask = np.tril(np.ones((T, T), bool))[None, None]
  if seg is not None:
    mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
  s = np.where(mask, s, -np.inf)
  max_logits = s.max(axis=(0, 2, 3))
  a = np.exp(s - s.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  o = np.einsum("bhqs,bshv->bqhv", a, v)
  if cfg.mla_output_gate:
    o = o / (1 + np.exp(-np.einsum("btd,dhv->bthv", x, p(m.g_proj))))
  return np.einsum("bthv,hvd->btd", o, p(m.o_proj)), max_logits


@pytest.mark.parametrize("segments", [False, True])
def test_gated_mla_formula(segments, x64):
  cfg = tiny_cfg()
  m = randomize(MLA(cfg, F64, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 11, cfg.hidden_size))
  seg = np.array([[1] * 4 + [2] * 7, [0] * 3 + [5] * 8]) if segments else None
  got, max_logits = m(jnp.asarray(x), segment_ids=None if seg is None else jnp.asarray(seg))
  want, want_logits = np_mla(m, cfg, x, seg)
  np.testing.assert_allclose(np64(got), want, atol=1e-10, rtol=1e-10)
  np.testing.assert_allclose(np64(max_logits), want_logits, atol=1e-10, rtol=1e-10)


def test_packed_segments_equal_separate_sequences(x64):
  """Two sequences packed in one row attend as each does alone. float64: the runs differ only
  in summation order (softmax sums over 12 keys with exact zeros vs 5 or 7), which moves the
  O(1) outputs by ~1e-15; 1e-12 holds on any machine, and a leak across the boundary moves
  them by >= 1e-3 (a float32 pair at a fixed 1e-6 would be two rounding noises compared)."""
  cfg = tiny_cfg()
  m = randomize(MLA(cfg, F64, rngs=nnx.Rngs(0)))
  x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 12, 32)))
  seg = jnp.asarray([[1] * 5 + [2] * 7])
  packed, _ = m(x, segment_ids=seg)
  np.testing.assert_allclose(np64(packed[:, :5]), np64(m(x[:, :5])[0]), atol=1e-12, rtol=0)
  np.testing.assert_allclose(np64(packed[:, 5:]), np64(m(x[:, 5:])[0]), atol=1e-12, rtol=0)
  assert np.abs(np64(packed[:, 5:]) - np64(m(x)[0][:, 5:])).max() > 1e-3  # packing matters


def test_kimi_linear_mla_matches_transformers(x64):
  torch = pytest.importorskip("torch")
  from transformers import KimiLinearConfig
  from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention
  cfg = kimi_linear_cfg()
  m = randomize(MLA(cfg, F64, rngs=nnx.Rngs(3)), 3)
  hf_cfg = KimiLinearConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                            q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=8)
  hf_cfg._attn_implementation = "eager"
  ref = KimiLinearAttention(hf_cfg, layer_idx=3).double()
  t = lambda a: torch.from_numpy(np.array(np64(a)))
  H, nope, dv, kv = 2, 8, 8, 8
  with torch.no_grad():
    ref.q_proj.weight.copy_(t(m.q_proj.kernel[...]).reshape(32, -1).T)
    ref.kv_a_proj_with_mqa.weight.copy_(t(m.kv_a_proj.kernel[...]).T)
    ref.kv_a_layernorm.weight.copy_(t(m.kv_a_norm.weight[...]))
    kv_b = torch.cat([t(m.k_b_proj.kernel[...]), t(m.v_b_proj.kernel[...])], -1)  # [kv, H, nope+v]
    ref.kv_b_proj.weight.copy_(kv_b.permute(1, 2, 0).reshape(H * (nope + dv), kv))
    ref.o_proj.weight.copy_(t(m.o_proj.kernel[...]).reshape(H * dv, 32).T)
  x = np.random.default_rng(4).standard_normal((2, 10, 32))
  causal = torch.full((10, 10), float("-inf"), dtype=torch.float64).triu(1)[None, None]
  want, _ = ref(torch.from_numpy(x), attention_mask=causal)
  # transformers' eager attention takes its softmax in fp32 even in a float64 module, so the
  # agreement is fp32-level: docs/correctness.md's 1e-5 for a layer against PyTorch
  np.testing.assert_allclose(np64(m(jnp.asarray(x))[0]), want.detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("make", [tiny_cfg, kimi_linear_cfg])
def test_latent_cache_attention(make, x64):
  """Attention over the latent cache (docs/inference.md), k_b / v_b absorbed or expanded, equals the
  layer's full-sequence attention at every position (float64, 1e-12): a whole prompt at once,
  then token by token; a left-padded row (junk before `start`) equals the row alone."""
  cfg = make()
  m = randomize(MLA(cfg, F64, rngs=nnx.Rngs(5)), 5)
  x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 9, cfg.hidden_size)))
  full, _ = m(x)
  c, rot = m.latent(x)
  pad = lambda a: jnp.pad(a, ((0, 0), (0, 3), (0, 0)))  # S = 12 > T
  start = jnp.zeros((2,), jnp.int32)
  for absorb in (True, False):
    got = m.attend_latent(x, pad(c), pad(rot), jnp.arange(9), start, absorb=absorb)
    np.testing.assert_allclose(np64(got), np64(full), atol=1e-12, rtol=0)
    steps = [m.attend_latent(x[:, t:t + 1], pad(c), pad(rot), jnp.asarray([t]), start,
                             absorb=absorb) for t in range(9)]
    np.testing.assert_allclose(np64(jnp.concatenate(steps, 1)), np64(full), atol=1e-12, rtol=0)
  junk = jnp.concatenate([x[:, :4] * 50, x[:, 4:]], 1)
  c, rot = m.latent(junk)
  got = m.attend_latent(junk, c, rot, jnp.arange(9), jnp.asarray([4, 4], jnp.int32))
  np.testing.assert_allclose(np64(got[:, 4:]), np64(m(x[:, 4:])[0]), atol=1e-12, rtol=0)


def test_latent_cache_attention_applies_lora_adapters(x64):
  """With LoRA adapters on k_b / v_b (nonzero B), the absorbed products (which read the weights,
  not the projections) still equal the full-sequence attention, which applies the adapters."""
  cfg = tiny_cfg()
  m = randomize(MLA(cfg, F64, rngs=nnx.Rngs(5)), 5)
  rng = np.random.default_rng(3)
  for proj in (m.k_b_proj, m.v_b_proj):  # as model/lora.py attaches one, B drawn nonzero
    fan_out = int(np.prod(proj.kernel.shape[1:]))
    proj.lora = nnx.data(nnx.LoRA(proj.kernel.shape[0], 2, fan_out, param_dtype=jnp.float64,
                                  rngs=nnx.Rngs(1)))
    proj.lora.lora_b.set_value(jnp.asarray(rng.standard_normal((2, fan_out))))
    proj.lora_scale, proj.lora_in_dims = 0.5, 1
  x = jnp.asarray(rng.standard_normal((2, 9, cfg.hidden_size)))
  full, _ = m(x)
  c, rot = m.latent(x)
  start = jnp.zeros((2,), jnp.int32)
  for absorb in (True, False):
    got = m.attend_latent(x, c, rot, jnp.arange(9), start, absorb=absorb)
    np.testing.assert_allclose(np64(got), np64(full), atol=1e-12, rtol=0)


def test_mla_flash_equals_dense(x64):
  """attention="flash" (pallas_kernels.flash_attention) gives the dense path's numbers: float64,
  every value a softmax-weighted sum of O(1) terms over <= 10 keys."""
  cfg = configs.get("tiny")
  f64 = F64.replace(matmul_precision="highest")
  mla = MLA(cfg, f64, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 10, cfg.hidden_size), jnp.float64)
  seg = jnp.asarray([[1] * 6 + [2] * 4, [1] * 10])
  flash = MLA(cfg, f64.replace(attention="flash", attention_block=4), rngs=nnx.Rngs(0))
  y_ref, m_ref = mla(x, segment_ids=seg)
  y, m = flash(x, segment_ids=seg)
  np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-12)
  np.testing.assert_allclose(m, m_ref, rtol=0, atol=1e-12)
