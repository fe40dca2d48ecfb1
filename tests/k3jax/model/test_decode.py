"""Decoding through the cache (docs/inference.md, docs/correctness.md) equals the full-sequence
forward.

float64: against the official float64 decode (`decode_logits_fp64`, itself equal to the
official forward to ~1e-12) and forward, to 1e-9: only summation order differs, measured
~1e-12. float32: two float32 evaluations of one function in different orders (all T tokens in
one pass, and a prefill followed by one token at a time) carry rounding errors of one
distribution, so the decode's distance from the float64 truth is judged by the one-pass float32
evaluation's own distance: its RMS over all B*T*V logits (a stable statistic) at most 2x (the
model forward and the decode of k3_tiny_a measured 3.8e-5 and 4.1e-5, 1.07x), and its max
within docs/correctness.md's float32 noise floor of this network (2e-3). A decode bug (a token lost,
absorbed twice or misplaced) shows as O(1). The one-pass evaluation is the cached path over
all T tokens at once (the same compiled chunk as the prefills here), not the model's
forward, to save a compilation; its error is the same kind of float32 full-sequence rounding.

All tests run at batch 2 and one cache length (engine.cache_len rounds to 256), so the
compiled prefill / step functions (module-level jit in k3jax.generate.static_batch) are shared.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert.hf_load import load_model
from k3jax.execution import Execution
from k3jax.generate.static_batch import StaticBatch, cache_len
from k3jax.info import summary
from k3jax.model.cache import bytes_per_request, init_cache, stack, unstack
from k3jax.model.transformer import K3Model
from k3jax.parity import NUMERICS
from tests.k3jax.model.helpers import kimi_linear_cfg, randomize, tiny_cfg

FILES = ("reference.npz", "reference_b2_t130.npz")
MAX_LEN = 256   # every cache in this file (cache_len of the longest use)
CHUNK = 64      # every prefill in this file runs chunks of 64 (and of 7 once)
RMS_RATIO = 2.0
FLOAT32_NOISE = 2e-3


@pytest.fixture(scope="module")
def ckpt(reference_dir):
  return os.path.join(reference_dir, "k3_tiny_a")


@pytest.fixture(scope="module")
def ref(ckpt):
  return {f: dict(np.load(os.path.join(ckpt, f))) for f in FILES}


@pytest.fixture(scope="module")
def tiny64(ckpt):
  with jax.enable_x64(True):
    return load_model(ckpt, NUMERICS["float64"])[0]


def decode(model, ids, prefill, chunk=CHUNK, start=None):
  """(logits [B, T, V] float64 of the real positions, final cache, pads in front): the first
  `prefill` tokens in chunks, then one token at a time. The prompt is left-padded to whole
  chunks first (as the engine does), so every prefill here runs at one compiled shape."""
  gen = StaticBatch(model, prefill_chunk=chunk)
  b, t = ids.shape
  start = np.zeros(b, np.int32) if start is None else start
  pads = -prefill % chunk
  prompt = np.pad(np.asarray(ids[:, :prefill]), ((0, 0), (pads, 0)), constant_values=3)
  logits, cache, extra = gen.prefill(prompt, start + pads, MAX_LEN)
  assert extra == 0
  outs = [np.asarray(logits[:, pads:], np.float64)]
  for i in range(prefill, t):
    step, cache = gen.extend(jnp.asarray(ids[:, i:i + 1]), cache)
    outs.append(np.asarray(step, np.float64))
  return np.concatenate(outs, 1), cache, pads


def rms(a):
  return float(np.sqrt(np.mean(np.square(a))))


@pytest.mark.parametrize("fname", FILES)
def test_reference_decode_float64(tiny64, ref, fname, x64):
  r = ref[fname]
  got, cache, pads = decode(tiny64, r["input_ids"], int(r["decode_prefill_len"]))
  assert np.abs(got - r["decode_logits_fp64"]).max() <= 1e-9
  assert np.abs(got - r["logits_fp64_unrounded"]).max() <= 1e-9
  assert int(cache.length) == pads + r["input_ids"].shape[1]


def test_reference_decode_float32(ckpt, ref):
  model = load_model(ckpt, NUMERICS["float32"])[0]
  r = ref["reference.npz"]
  t = r["input_ids"].shape[1]
  one_pass, _, _ = decode(model, r["input_ids"], t)
  got, _, _ = decode(model, r["input_ids"], int(r["decode_prefill_len"]))
  yardstick = rms(one_pass - r["logits_fp64_unrounded"])
  assert rms(got - r["decode_logits_fp64"]) <= RMS_RATIO * yardstick
  assert np.abs(got - r["decode_logits_fp64"]).max() <= FLOAT32_NOISE


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_same_caches_and_logits(tiny64, ref, chunk, x64):
  """Prefill of 70 tokens in chunks of 1 (the fused decode step), 7, or 64 (58 pads + 70
  tokens: 6 in the first chunk, 64 in the second) leaves the same KDA states, conv tails and
  MLA latents of the real positions, and gives the same logits (float64, summation order)."""
  ids = ref["reference_b2_t130.npz"]["input_ids"][:, :70]
  want, c_want, pads = decode(tiny64, ids, 70)
  got, c_got, _ = decode(tiny64, ids, 70, chunk=7) if chunk == 7 else decode(tiny64, ids, 1, 1)
  assert pads == 58
  np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
  c_got, c_want = stack(c_got), stack(c_want)
  for a, b in zip(c_got.kda, c_want.kda):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-10, rtol=0)
  for a, b in zip(c_got.mla, c_want.mla):
    np.testing.assert_allclose(np.asarray(a)[:, :, :70], np.asarray(b)[:, :, pads:pads + 70],
                               atol=1e-10, rtol=0)


def test_mixed_lengths_batch_equals_each_alone(tiny64, ref, x64):
  """Prompts of 20 and 13 tokens in one left-padded batch, then 4 decode steps: each row's
  logits equal the prompt run alone (float64, 1e-10). Pad positions carry junk tokens."""
  ids = ref["reference.npz"]["input_ids"][:, :24]
  a, b = ids[0], ids[1, 7:]                      # 20 + 4 and 13 + 4 tokens
  batch = np.stack([a, np.concatenate([np.full(7, 200, ids.dtype), b])])
  mixed, _, _ = decode(tiny64, batch, 20, start=np.array([0, 7], np.int32))
  alone_a, _, _ = decode(tiny64, np.stack([a, a]), 20)
  alone_b, _, _ = decode(tiny64, np.stack([b, b]), 13)
  np.testing.assert_allclose(mixed[0], alone_a[0], atol=1e-10, rtol=0)
  np.testing.assert_allclose(mixed[1, 7:], alone_b[0], atol=1e-10, rtol=0)


def random_model(cfg, ex, seed):
  """K3Model(cfg, ex) with randomize()'s weights, built without running the initialisers
  (each eager initialiser op would compile on its own)."""
  model = nnx.eval_shape(lambda: K3Model(cfg, ex, rngs=nnx.Rngs(0)))
  for _, var in nnx.to_flat_state(nnx.state(model)):
    var.set_value(jnp.zeros(var.shape, var.dtype))
  return randomize(model, seed)


@pytest.fixture(scope="module")
def kimi_linear():
  """A Kimi-Linear-shaped model (softplus gate, low-rank KDA gate, plain q_proj, no AttnRes,
  SwiGLU, MoE on the full width), 2 layers [KDA + dense, MLA + MoE], random weights, float64
  and float32 copies of the same numbers."""
  cfg = kimi_linear_cfg(num_layers=2, mla_layers=(1,))
  ex = Execution(dtype="float64", param_dtype="float64", matmul_precision="highest")
  with jax.enable_x64(True):
    m64 = random_model(cfg, ex, 3)
    state = jax.tree.map(lambda a: np.asarray(a, np.float32), nnx.state(m64))
  m32 = nnx.eval_shape(lambda: K3Model(cfg, ex.replace(dtype="float32", param_dtype="float32"),
                                       rngs=nnx.Rngs(0)))
  nnx.update(m32, jax.tree.map(jnp.asarray, state))
  ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 30)).astype(np.int32)
  return m64, m32, ids


def test_kimi_linear_decode(kimi_linear):
  m64, m32, ids = kimi_linear
  fwd = nnx.jit(lambda m, x: m(x).logits)
  with jax.enable_x64(True):
    truth = np.asarray(fwd(m64, jnp.asarray(ids)), np.float64)
    got64, _, _ = decode(m64, ids, 11)
  np.testing.assert_allclose(got64, truth, atol=1e-9, rtol=0)
  one_pass32, _, _ = decode(m32, ids, ids.shape[1])
  got32, _, _ = decode(m32, ids, 11)
  assert rms(got32 - truth) <= RMS_RATIO * rms(one_pass32 - truth)
  assert np.abs(got32 - truth).max() <= FLOAT32_NOISE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_bytes_equal_info(dtype):
  """Per request: the KDA state (fp32) and conv tails, and the MLA cache per position, are
  exactly `k3jax info`'s figures."""
  cfg = tiny_cfg()
  cache = init_cache(cfg, Execution(dtype=dtype), batch=3, max_len=16)
  got = bytes_per_request(cache)
  assert bytes_per_request(unstack(cache)) == got   # the per-layer layout holds the same
  want = summary(cfg, dtype)
  assert got["kda_state"] == want["kda_state_bytes_per_request"]
  assert got["kda_conv"] == want["kda_conv_state_bytes_per_request"]
  assert got["mla_per_token"] == want["mla_cache_bytes_per_token"]


def test_cache_len_buckets():
  assert cache_len(1) == cache_len(256) == 256 and cache_len(257) == 512


def test_stacked_scanned_layout(x64):
  """The stacked form (the model's stacks, layers scanned as in training; TPU/GPU) equals the
  forward (float64), on [MLA + dense, KDA, KDA] with the two KDA layers under a scan. (The
  per-layer form, which every other test here runs on the CPU, meets the same truths.)"""
  from k3jax.model import schedule
  cfg = tiny_cfg(num_layers=3, mla_layers=(0,))
  ex = Execution(dtype="float64", param_dtype="float64", matmul_precision="highest")
  assert any(r.scanned and r.count >= 2 for r in schedule.runs(cfg, scan=True))
  model = random_model(cfg, ex, 5)
  ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
  truth = np.asarray(nnx.jit(lambda m, x: m(x).logits)(model, jnp.asarray(ids)))
  for layout in ("stacked",):
    gen = StaticBatch(model, prefill_chunk=64, layout=layout)
    prompt = np.pad(ids[:, :5], ((0, 0), (59, 0)))
    logits, cache, _ = gen.prefill(prompt, np.full(2, 59, np.int32), MAX_LEN)
    outs = [np.asarray(logits[:, 59:])]
    for i in range(5, 9):
      step, cache = gen.extend(jnp.asarray(ids[:, i:i + 1]), cache)
      outs.append(np.asarray(step))
    np.testing.assert_allclose(np.concatenate(outs, 1), truth, atol=1e-10, rtol=0)
