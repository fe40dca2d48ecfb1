"""KDA's plain references (reference.py) and the fast jnp backend "xla_cpu"
(docs/model.md#kda-layer, docs/correctness.md).

The truth is the token-by-token recurrence (`naive_kda`) run in float64 on the very inputs the
float32 op gets, differentiated by JAX autodiff. Independent implementations meet the same
truth: fla's `naive_recurrent_kda` (loaded by file path, since `import fla` is blocked in tests)
and transformers' pure-torch KDA (recurrent and chunked) under torch autograd, both of which
compute in float32 whatever their inputs, and numpy transcriptions in float64. Tolerances
(tests/numerics.py): float32 results within 1e-5 of their scale of the truth, gate parameter
gradients within `sum_tolerance`; float64 implementations agree to 1e-12 (outputs) and 1e-10
(gradients) of the scale (float64 rounding, u = 2^-53, is ~1e-14 here). No two float32 results
are compared with each other.

Compile time dominates on a CPU, so the grid reuses shapes: the xla_cpu op compiles once per
(chunk count, heads, dtype, packed or not), and T = 1, 63, 64 share one chunk count.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_kernels.kda import chunk_kda, kda, kda_step, naive_kda, ops, reference
from tests import numerics
from tests.numerics import assert_close
from tests.pallas_kernels.kda import kda_cases

K, V = 16, 24  # K != V catches transposed state layouts
torch.set_num_threads(1)  # two xdist workers share two cores with XLA's own threads


# ----------------------------------------------------------------------------------------------
# inputs and independent references
# ----------------------------------------------------------------------------------------------


def inputs_and_cotangents(B, T, H, **kw):
  """kda_cases.make_inputs at this file's K, V, and the functional's weights for them."""
  args = kda_cases.make_inputs(B, T, H, K, V, **kw)
  return args, kda_cases.cotangents(args)


def jax_value_and_grads(fn, inputs, cotangents, segment_ids=None, with_state=True,
                        state_grad=True):
  """(o, s, grads w.r.t. q, k, v, g, beta[, s0]) of sum(o * wo) + sum(s * ws).

  With state_grad=False the initial state is a constant (so are the zeros an omitted state
  becomes), and "with" and "without initial state" share one compilation; ds0 is then None.
  """
  wo, ws = cotangents
  *xs, s0 = inputs
  s0 = s0 if with_state else None

  def loss(q, k, v, g, beta, s0):
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True,
              segment_ids=segment_ids)
    return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)

  argnums = tuple(range(6 if state_grad and with_state else 5))
  (_, (o, s)), grads = jax.value_and_grad(loss, argnums, has_aux=True)(*xs, s0)
  return o, s, tuple(grads) + (None,) * (6 - len(grads))


xla_cpu_op = functools.partial(kda, backend="xla_cpu")


@functools.cache
def fla_naive():
  """fla's naive_recurrent_kda, loaded from its file: importing the fla package is blocked."""
  path = importlib.metadata.distribution("fla-core").locate_file("fla/ops/kda/naive.py")
  spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.naive_recurrent_kda


def transformers_kda():
  from transformers.models.kimi_linear import modeling_kimi_linear as m
  return m.recurrent_kimi_delta_attention, m.chunk_kimi_delta_attention


def to_torch(*xs, grad=False):
  """float32 torch copies: the torch references compute in float32 (they cast to it)."""
  return [torch.tensor(np.asarray(x).astype(np.float32), requires_grad=grad) for x in xs]


def truth_value_and_grads(inputs, cotangents, **kw):
  """`jax_value_and_grads` of the naive recurrence in float64 on the same values."""
  return numerics.float64_truth(
      lambda i, c: jax_value_and_grads(naive_kda, i, c, **kw), inputs, cotangents)


def torch_value_and_grads(fn, inputs, cotangents, with_state=True):
  """The same functional through a torch reference, under torch autograd."""
  q, k, v, g, beta, s0 = to_torch(*inputs, grad=True)
  wo, ws = to_torch(*cotangents)
  o, s = fn(q, k, v, g, beta, s0 if with_state else None)
  ((o * wo).sum() + (s * ws).sum()).backward()
  grads = [x.grad for x in (q, k, v, g, beta)] + [s0.grad if with_state else None]
  return o.detach(), s.detach(), grads


def assert_grads_close(what, actual, expected, atol=numerics.ATOL):
  """numerics.assert_close on each of (dq, dk, dv, dg, dbeta, ds0) present in both."""
  names = ("dq", "dk", "dv", "dg", "dbeta", "ds0")
  for name, a, e in zip(names, actual, expected):
    if a is not None and e is not None:
      assert_close(f"{what} {name}", a, e, atol=atol)


# ----------------------------------------------------------------------------------------------
# the grid: xla_cpu op vs naive recurrence vs fla vs transformers (outputs, state, gradients)
# ----------------------------------------------------------------------------------------------

# H = 3 with and without an initial state; H = 1 (batch 2) where T = 1, 63, 64 share a chunk
# count, and at T = 1000. The gradient w.r.t. the initial state is checked at T = 1000 (and in
# the packed-sequence test); elsewhere the state is a constant so that with and without an
# initial state share one compilation.
GRID = [(T, 3, init) for T in (1, 63, 64, 65, 130) for init in (False, True)]
GRID += [(T, 1, False) for T in (1, 63, 64)] + [(1000, 3, True), (1000, 1, False)]


@pytest.mark.parametrize("T,H,init", GRID)
def test_xla_cpu_matches_references(T, H, init):
  inputs, cot = inputs_and_cotangents(1 if H == 3 else 2, T, H, seed=T + H)
  opts = dict(with_state=init, state_grad=T == 1000)
  o, s, grads = jax_value_and_grads(xla_cpu_op, inputs, cot, **opts)

  # The truth: the token-by-token recurrence in float64, differentiated by JAX autodiff.
  o_n, s_n, grads_n = truth_value_and_grads(inputs, cot, **opts)
  assert_close("o vs float64 naive", o, o_n)
  assert_close("state vs float64 naive", s, s_n)
  assert_grads_close("vs float64 naive autodiff", grads, grads_n)

  # fla's recurrence under torch autograd (float32): the same function as the truth.
  fla = lambda q, k, v, g, b, s0: fla_naive()(q, k, v, g, b, initial_state=s0,
                                              output_final_state=True)
  o_f, s_f, grads_f = torch_value_and_grads(fla, inputs, cot, with_state=init)
  assert_close("fla o vs float64 naive", o_f, o_n)
  assert_close("fla state vs float64 naive", s_f, s_n)
  assert_grads_close("fla autograd vs float64 naive", grads_f, grads_n)

  # transformers' torch KDA (float32): the recurrent one under autograd, the chunked one
  # forward only. (Autograd through transformers' chunked form is itself ~2e-5 off the
  # gradient: it exponentiates differences of chunk-level cumsums.)
  recurrent, chunked = transformers_kda()
  hf = lambda q, k, v, g, b, s0: recurrent(q, k, v, g, b, s0, True,
                                           use_qk_l2norm_in_kernel=False)
  o_r, s_r, grads_r = torch_value_and_grads(hf, inputs, cot, with_state=init)
  assert_close("transformers recurrent o vs float64 naive", o_r, o_n)
  assert_close("transformers recurrent state vs float64 naive", s_r, s_n)
  assert_grads_close("transformers autograd vs float64 naive", grads_r, grads_n)
  q, k, v, g, beta, s0 = to_torch(*inputs)
  o_c, s_c = chunked(q, k, v, g, beta, initial_state=s0 if init else None,
                     output_final_state=True, use_qk_l2norm_in_kernel=False)
  assert_close("transformers chunk o vs float64 naive", o_c, o_n)
  assert_close("transformers chunk state vs float64 naive", s_c, s_n)


def test_no_state_output():
  (q, k, v, g, beta, _), _ = inputs_and_cotangents(2, 70, 3)
  o, s = kda(q, k, v, g, beta, backend="xla_cpu")
  assert s is None and o.shape == v.shape and o.dtype == v.dtype


# ----------------------------------------------------------------------------------------------
# packed sequences
# ----------------------------------------------------------------------------------------------


def test_packed_segments_equal_separate_runs():
  """Row 0 packs (40, 64, 26) tokens (starts inside chunks), row 1 packs (5, 59, 66) (a start
  exactly on a chunk edge): each row equals its sequences run one by one."""
  packings = ((40, 64, 26), (5, 59, 66))
  T, H = 130, 3
  inputs, cot = inputs_and_cotangents(2, T, H, seed=11, decay="mild")
  ids = [np.repeat(np.arange(len(p)) + 7, p) for p in packings]  # only changes of id count
  segment_ids = jnp.asarray(np.stack(ids))
  o, s, grads = jax_value_and_grads(xla_cpu_op, inputs, cot, segment_ids=segment_ids)

  # The truth: the recurrence in float64 over the packed rows; each sequence alone through
  # fla's recurrence (float32) meets it (the initial state belongs to the first one).
  o_n, s_n, grads_n = truth_value_and_grads(inputs, cot, segment_ids=segment_ids)
  q, k, v, g, beta, s0 = to_torch(*inputs)
  for row, lengths in enumerate(packings):
    r = slice(row, row + 1)
    bounds = np.cumsum((0,) + lengths)
    o_parts, state = [], None
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
      o_p, state = fla_naive()(q[r, a:b], k[r, a:b], v[r, a:b], g[r, a:b], beta[r, a:b],
                               initial_state=s0[r] if n == 0 else None,
                               output_final_state=True)
      o_parts.append(o_p)
    assert_close(f"row {row} separate fla runs", torch.cat(o_parts, 1), o_n[r])
    assert_close(f"row {row} its last sequence's fla state", state, s_n[r])

  assert_close("o vs float64 naive", o, o_n)
  assert_close("state vs float64 naive", s, s_n)
  assert_grads_close("vs float64 naive autodiff", grads, grads_n)


# ----------------------------------------------------------------------------------------------
# fused input preparation: gates, l2norm, beta sigmoid
# ----------------------------------------------------------------------------------------------


def numpy_prepare(q, k, g, beta, A_log, dt_bias, gate, lower_bound):
  q, k, g, beta, A_log, dt_bias = (np.asarray(x, np.float64)
                                   for x in (q, k, g, beta, A_log, dt_bias))
  l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
  sigmoid = lambda x: 1 / (1 + np.exp(-x))
  x = g + dt_bias.reshape(g.shape[-2:])
  a = np.exp(A_log).reshape(-1, 1)
  g = lower_bound * sigmoid(a * x) if gate == "lower_bound" else -a * np.log1p(np.exp(x))
  return l2(q), l2(k), g, sigmoid(beta)


def torch_gate(g, A_log, dt_bias, gate, lower_bound):
  x = g + dt_bias.reshape(g.shape[-2:])
  a = A_log.exp().reshape(-1, 1)
  if gate == "lower_bound":
    return lower_bound * torch.sigmoid(a * x)
  return -a * torch.nn.functional.softplus(x)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_prepared_inputs(gate):
  B, T, H = 1, 130, 3  # the grid's shape: the xla_cpu core's compilation is shared
  ks = jax.random.split(jax.random.key(3), 8)
  q, k = (3.0 * jax.random.normal(ks[i], (B, T, H, K)) for i in (0, 1))  # raw, not unit
  v = jax.random.normal(ks[2], (B, T, H, V))
  g_raw = jax.random.normal(ks[3], (B, T, H, K))
  beta_raw = jax.random.normal(ks[4], (B, T, H))
  A_log = jax.random.uniform(ks[5], (H,), minval=0.0, maxval=2.0)
  dt_bias = 0.5 * jax.random.normal(ks[6], (H, K))
  wo = jax.random.normal(ks[7], (B, T, H, V))
  opts = dict(gate=gate, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True,
              use_beta_sigmoid=True)

  # The preparation itself vs a numpy transcription in float64: a few elementwise roundings
  # (exp, sigmoid, rsqrt), so 1e-6 of each tensor's scale (the softplus gate reaches ~30).
  prepared = reference.prepare_inputs(q, k, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias,
                                      raw=reference.RawInputs(
                                          gate=gate, lower_bound=-5.0, use_qk_l2norm=True,
                                          use_beta_sigmoid=True))
  expected = numpy_prepare(q, k, g_raw, beta_raw, A_log, dt_bias, gate, -5.0)
  for name, a, e in zip(("q", "k", "g", "beta"), prepared, expected):
    assert_close(name, a, e, atol=1e-6)

  # The op with raw inputs vs the truth: the naive backend in float64 on the same raw values.
  def loss(q, k, v, g_raw, beta_raw, A_log, dt_bias, backend):
    o, _ = kda(q, k, v, g_raw, beta_raw, backend=backend, **{**opts, "A_log": A_log,
                                                            "dt_bias": dt_bias})
    return jnp.sum(o * wo), o

  argnums = (0, 1, 2, 3, 4, 5, 6)
  raw = (q, k, v, g_raw, beta_raw, A_log, dt_bias)
  (_, o), grads = jax.value_and_grad(loss, argnums, has_aux=True)(*raw, "xla_cpu")
  (_, o_n), grads_n = numerics.float64_truth(
      lambda *a: jax.value_and_grad(loss, argnums, has_aux=True)(*a, "naive"), *raw)
  assert_close("o xla_cpu vs float64 naive", o, o_n)
  # dA_log and d dt_bias sum per-token terms over (B, T, K) and (B, T): dA_log's term is
  # dL/dA_log's share of each token, dx (x + dt_bias) for the lower-bound gate and
  # dx softplus(x + dt_bias) / sigmoid(x + dt_bias) for the softplus gate (dx = dL/dg_raw).
  dx, y = grads_n[3], np.asarray(g_raw, np.float64) + np.asarray(dt_bias, np.float64)
  alog_terms = dx * (y if gate == "lower_bound" else np.logaddexp(0, y) * (1 + np.exp(-y)))
  tols = [None] * 5 + [numerics.sum_tolerance(alog_terms, (0, 1, 3)),
                       numerics.sum_tolerance(dx, (0, 1))]

  # transformers' recurrent KDA normalises q/k itself (use_qk_l2norm_in_kernel=True); the gate
  # and beta sigmoid are written out in torch (float32). It must meet the truth too.
  t = to_torch(*raw, grad=True)
  recurrent, chunked = transformers_kda()
  g_t, beta_t = torch_gate(t[3], t[5], t[6], gate, -5.0), torch.sigmoid(t[4])
  o_t, _ = recurrent(t[0], t[1], t[2], g_t, beta_t, None, False, use_qk_l2norm_in_kernel=True)
  (o_t * to_torch(wo)[0]).sum().backward()
  assert_close("transformers recurrent o (l2norm in kernel)", o_t.detach(), o_n)
  names = ("dq", "dk", "dv", "dg_raw", "dbeta_raw", "dA_log", "ddt_bias")
  for name, a, a_n, x, tol in zip(names, grads, grads_n, t, tols):
    for who, grad in (("xla_cpu", a), ("torch autograd", x.grad)):
      if tol is None:
        assert_close(f"{name} {who} vs float64 naive", grad, a_n)
      else:
        assert_close(f"{name} {who} vs float64 naive", grad, a_n, tol)
  with torch.no_grad():
    o_c, _ = chunked(t[0], t[1], t[2], g_t, beta_t, initial_state=None,
                     output_final_state=False, use_qk_l2norm_in_kernel=True)
  assert_close("transformers chunk o (l2norm in kernel)", o_c, o_n)


def test_gate_argument_errors():
  (q, k, v, g, beta, _), _ = inputs_and_cotangents(1, 8, 2)
  with pytest.raises(ValueError, match="A_log"):
    kda(q, k, v, g, beta, gate="softplus")
  with pytest.raises(ValueError, match="lower_bound"):
    kda(q, k, v, g, beta, gate="lower_bound", A_log=jnp.zeros(2))
  with pytest.raises(ValueError, match="gate"):
    kda(q, k, v, g, beta, gate="tanh")


def test_raw_inputs_bundle_or_keywords():
  """The op takes the raw-input options as one RawInputs or as its fields' keywords (the
  signature before the bundle): the same program, so the same bits; never both at once."""
  q, k, v, x, logits, A_log, dt_bias, _ = kda_cases.make_raw_inputs(1, 70, 2, K, V, seed=4)
  params = dict(A_log=A_log, dt_bias=dt_bias, backend="xla_cpu")
  o_bundle, _ = kda(q, k, v, x, logits, raw=kda_cases.K3_RAW, **params)
  o_keywords, _ = kda(q, k, v, x, logits, gate="lower_bound", lower_bound=-5.0,
                      use_qk_l2norm=True, use_beta_sigmoid=True, **params)
  np.testing.assert_array_equal(o_bundle, o_keywords)
  assert reference.RawInputs(gate="softplus").gate is reference.Gate.SOFTPLUS
  with pytest.raises(TypeError, match="not both"):
    kda(q, k, v, x, logits, raw=kda_cases.K3_RAW, use_qk_l2norm=True, **params)
  with pytest.raises(TypeError, match="use_qk_norm"):
    kda(q, k, v, x, logits, use_qk_norm=True, **params)


# ----------------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------------


def numpy_recurrence(q, k, v, g, beta, s0, scale):
  """float64 numpy transcription of docs/model.md#kda-layer, token by token."""
  q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0))
  o = np.zeros(v.shape)
  for t in range(q.shape[1]):
    s = s * np.exp(g[:, t])[..., None]
    delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], s))
    s = s + k[:, t, :, :, None] * delta[:, :, None, :]
    o[:, t] = np.einsum("bhk,bhkv->bhv", scale * q[:, t], s)
  return o, s


def test_float64(x64):
  inputs, cot = inputs_and_cotangents(1, 130, 2, seed=5, dtype=jnp.float64)
  o, s, grads = jax_value_and_grads(xla_cpu_op, inputs, cot)
  assert o.dtype == s.dtype == jnp.float64
  o_np, s_np = numpy_recurrence(*inputs, scale=K**-0.5)
  assert_close("o vs numpy float64", o, o_np, atol=1e-12)
  assert_close("state vs numpy float64", s, s_np, atol=1e-12)
  o_n, s_n, grads_n = jax_value_and_grads(naive_kda, inputs, cot)
  assert_close("o vs naive float64", o, o_n, atol=1e-12)
  assert_grads_close("float64 vs naive autodiff", grads, grads_n, atol=1e-10)


def test_bfloat16_inputs():
  """bf16 q, k, v (g, beta float32, as the model passes them) compute in float32: the result
  equals the float64 truth on the same bf16 values up to float32 error and the final bf16
  rounding of o and of dq, dk, dv (half a bf16 ulp). o's cotangent is bf16 too (it is o's
  dtype), so the truth gets the same rounded cotangent."""
  inputs, cot = inputs_and_cotangents(1, 130, 3, seed=6, dtype=jnp.bfloat16)
  o, s, grads = jax_value_and_grads(xla_cpu_op, inputs, cot, state_grad=False)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert [d.dtype for d in grads[:5]] == [jnp.bfloat16] * 3 + [jnp.float32] * 2
  o_n, s_n, grads_n = truth_value_and_grads(inputs, cot, state_grad=False)
  assert_close("o", o, o_n)
  assert_close("state", s, s_n)
  assert_grads_close("grads", grads, grads_n)


# ----------------------------------------------------------------------------------------------
# numerical range
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decay", ["strong", "extreme"])
def test_strong_decay_stays_finite_and_exact(decay):
  """g ~ -5 on every token and channel (130 tokens, two full chunks): the chunk cumsum reaches
  -320, so any e^{G_i} / e^{G_j} would overflow. 'extreme' (g ~ -30) exceeds xla_cpu's
  max_step_decay and is clamped, which must stay invisible at float32 precision."""
  inputs, cot = inputs_and_cotangents(1, 130, 3, seed=7, decay=decay)
  o, s, grads = jax_value_and_grads(xla_cpu_op, inputs, cot, state_grad=False)
  for x in (o, s) + tuple(grads[:5]):
    assert np.all(np.isfinite(np.asarray(x)))
  o_n, s_n, grads_n = truth_value_and_grads(inputs, cot, state_grad=False)
  assert_close("o vs float64 naive", o, o_n)
  assert_close("state vs float64 naive", s, s_n)
  assert_grads_close("vs float64 naive autodiff", grads, grads_n)


# ----------------------------------------------------------------------------------------------
# the plain chunked reference, decoding, dispatch, structure of the backward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [False, True])
def test_reference_chunk_kda(raw):
  """reference.chunk_kda (the chunked form written plainly) against the recurrence in float64,
  packed, with an initial state, differentiated by autodiff; with K3's raw inputs too."""
  B, T, H = 2, 100, 3
  if raw:
    args = kda_cases.make_raw_inputs(B, T, H, K, V, seed=8)
    opts = {"raw": kda_cases.K3_RAW}
  else:
    args, opts = kda_cases.make_inputs(B, T, H, K, V, seed=8), {}
  argnums = (0, 1, 2, 3, 4, len(args) - 1)  # q, k, v, g (or x), beta (or logits), h0
  seg = jnp.asarray(np.repeat([[0, 1]], [30, 70], axis=1).repeat(2, 0))
  cot = kda_cases.cotangents(args)
  fn = lambda ref: (lambda *a, **kw: ref(*a[:5], **dict(zip(("A_log", "dt_bias"), a[5:])),
                                          **opts, **kw))
  o, s, grads = kda_cases.run_with_grads(fn(chunk_kda), args, seg, cot, argnums)
  o_n, s_n, grads_n = kda_cases.truth_with_grads(fn(naive_kda), args, seg, cot, argnums)
  assert_close("o", o, o_n)
  assert_close("state", s, s_n)
  assert_grads_close("chunk_kda autodiff vs float64 naive", grads, grads_n)


def test_decode_steps_continue_the_sequence():
  """Prefill with the xla_cpu op, then kda_step token by token == the full sequence (its
  float64 truth)."""
  (q, k, v, g, beta, s0), _ = inputs_and_cotangents(2, 75, 3, seed=9)
  o_full, s_full = numerics.float64_truth(
      lambda *a: naive_kda(*a[:5], initial_state=a[5], output_final_state=True),
      q, k, v, g, beta, s0)
  o_pre, state = kda(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67],
                     initial_state=s0, output_final_state=True, backend="xla_cpu")
  outs = [o_pre]
  for t in range(67, 75):
    o_t, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    outs.append(o_t[:, None])
  assert_close("decode outputs", jnp.concatenate(outs, 1), o_full)
  assert_close("decode state", state, s_full)


def test_dispatch(monkeypatch):
  (q, k, v, g, beta, _), _ = inputs_and_cotangents(2, 70, 3)
  assert jax.default_backend() == "cpu" and ops.default_backend() == "xla_cpu"
  o_default, _ = kda(q, k, v, g, beta)
  o_fast, _ = kda(q, k, v, g, beta, backend="xla_cpu")
  np.testing.assert_array_equal(o_default, o_fast)  # the same program: bit-identical
  with pytest.raises(ValueError, match="'cuda_magic'"):
    kda(q, k, v, g, beta, backend="cuda_magic")
  # On a TPU host whose Pallas module cannot be imported, the default falls back to xla_cpu.
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  monkeypatch.setitem(__import__("sys").modules, "pallas_kernels.kda.tpu", None)
  assert ops.default_backend() == "pallas_tpu"
  np.testing.assert_array_equal(kda(q, k, v, g, beta)[0], o_fast)
  with pytest.raises(ImportError, match="pallas_tpu"):
    kda(q, k, v, g, beta, backend="pallas_tpu")


def _scan_lengths(jaxpr):
  """Lengths of every scan in a jaxpr, nested ones included."""
  def subjaxprs(value):
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a ClosedJaxpr
      yield value.jaxpr
    elif hasattr(value, "eqns"):  # a Jaxpr
      yield value
    elif isinstance(value, (tuple, list)):
      for v in value:
        yield from subjaxprs(v)

  lengths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      lengths.append(eqn.params["length"])
    for sub in subjaxprs(list(eqn.params.values())):
      lengths += _scan_lengths(sub)
  return lengths


def test_backward_scans_chunks_not_tokens():
  """The xla_cpu op's gradient walks chunks (T / 64 steps), never tokens."""
  (q, k, v, g, beta, s0), _ = inputs_and_cotangents(1, 640, 1)
  grad = jax.grad(lambda *a: jnp.sum(kda(*a, backend="xla_cpu")[0]), argnums=(0, 1, 2, 3, 4))
  lengths = _scan_lengths(jax.make_jaxpr(grad)(q, k, v, g, beta).jaxpr)
  assert lengths and set(lengths) == {10}, lengths
