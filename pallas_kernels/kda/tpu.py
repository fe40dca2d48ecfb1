"""Chunked KDA forward and backward in Pallas Mosaic TPU (docs/kernels.md#kda-backends).

Grid (B, H, NT): batch and heads "parallel", the chunk axis innermost and "arbitrary" so one
core walks the chunks of a (b, h) in order and carries the [K,V] float32 state in VMEM scratch.
Blocks are one chunk of one head ([64, K] tiles of the head-major layout from `_layout`), with
K and V padded to multiples of 128 so every tile is lane-dense.

Forward: per chunk `_chunk_math.chunk_fwd`; when differentiating it also writes the state
entering every chunk (residual [B,H,NT,K,V] float32).
Backward: the same grid with the chunk index reversed; each step recomputes its chunk's forward
intermediates from the stored entering state and carries dS (float32 scratch) to the chunk
before. Inputs may be bf16 or float32; all math and accumulation is float32, and every matmul
runs at Precision.HIGHEST (the 1e-5 contract; the MXU then takes several bf16 passes).

Raw inputs (static `fused`, see _chunk_math.Fused): each step prepares its chunk in float32 as it
loads it (q/k l2norm, beta sigmoid, K3's gate from the per-head A_log / dt_bias rows), and the
backward step recomputes that and returns the gradients w.r.t. the raw inputs; the wrapper turns
the raw gate's gradient into those of A_log and dt_bias.

Unlike the GPU backend, one kernel per direction is enough: VMEM holds every [64,64] / [64,K]
intermediate of a chunk comfortably (it compiles for v5e and v6e; see test_tpu_aot.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import _layout, _wrapper
from pallas_kernels.kda.reference import PREPARED, RawInputs

C = cm.C
LANES = 128
_f32 = jnp.float32


def _interpret_arg(interpret):
  """interpret=True -> Pallas TPU interpret mode (simulates VMEM scratch, grid order)."""
  if interpret is True:
    return pltpu.InterpretParams()
  return interpret or False


def _specs(NT, K, V, reverse: bool):
  """BlockSpecs for the per-chunk inputs, shared by the forward and backward calls."""
  sq = pl.squeezed
  ci = (lambda c: NT - 1 - c) if reverse else (lambda c: c)
  tile = lambda n: pl.BlockSpec((sq, sq, C, n), lambda b, h, c: (b, h, ci(c), 0))
  return dict(
      k=tile(K), v=tile(V), beta=tile(1),
      rc=pl.BlockSpec((sq, C, 1), lambda b, h, c: (b, ci(c), 0)),
      rr=pl.BlockSpec((sq, sq, 1, C), lambda b, h, c: (b, ci(c), 0, 0)),
      state=pl.BlockSpec((sq, sq, K, V), lambda b, h, c: (b, h, 0, 0)),
      chunk_state=pl.BlockSpec((sq, sq, sq, K, V), lambda b, h, c: (b, h, ci(c), 0, 0)),
      head_row=pl.BlockSpec((sq, 1, K), lambda b, h, c: (h, 0, 0)),
  )


_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _load(fused, c_data, q_ref, k_ref, g_ref, beta_ref, head_refs):
  """The chunk's q, k, g, beta in float32, prepared in-kernel from raw inputs if `fused`."""
  raw = (q_ref[...].astype(_f32), k_ref[...].astype(_f32), g_ref[...].astype(_f32),
         beta_ref[...])
  if not fused.active:
    return raw, None
  alog_r, dtb_r = (r[...] for r in head_refs) if head_refs else (None, None)
  return cm.prepare(fused, *raw, alog_r, dtb_r, c_data * C)


def _fwd_kernel(*refs, scale, save_states, fused):
  n_in = 10 if fused.gate else 8
  (q_ref, k_ref, v_ref, g_ref, beta_ref, rc_ref, rr_ref, h0_ref), head_refs = (
      refs[:8], refs[8:n_in])
  o_ref, ht_ref, *rest = refs[n_in:]
  states_ref, s_scr = (rest[0], rest[1]) if save_states else (None, rest[0])
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    s_scr[...] = h0_ref[...]

  s0 = s_scr[...]
  if save_states:
    states_ref[...] = s0
  (q, k, g, beta), _ = _load(fused, c, q_ref, k_ref, g_ref, beta_ref, head_refs)
  o, s1 = cm.chunk_fwd(q, k, v_ref[...].astype(_f32), g, beta, rc_ref[...], rr_ref[...], s0,
                       scale, cm.RESHAPE_OPS)
  o_ref[...] = o.astype(o_ref.dtype)
  s_scr[...] = s1

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    ht_ref[...] = s1


def _cost(passes: int, q, *arrays) -> pl.CostEstimate:
  """What a kernel does, for XLA's cost analysis (a custom call counts nothing otherwise, and
  `k3jax plan` reads compiled FLOPs): `passes` forwards of the chunked algorithm over the
  padded [B, H, Tp] x K, V it runs (the backward recomputes the forward and does twice its
  work in gradients), two exponentials per gate element per pass, and every operand and
  result read or written once."""
  B, H, Tp, K = q.shape
  V = arrays[1].shape[-1]
  return pl.CostEstimate(
      flops=int(passes * B * H * Tp * cm.flops_per_token(K, V)),
      transcendentals=int(passes * 2 * B * H * Tp * K),
      bytes_accessed=int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                             for x in (q, *arrays))))


def _head_args(s, alog, dtb):
  """Specs and operands of the per-head gate rows: only when the gate is fused."""
  return ([s["head_row"]] * 2, [alog, dtb]) if alog is not None else ([], [])


def _fwd_call(q, k, v, g, beta, h0, rc, rr, alog, dtb, *, scale, save_states, interpret, fused):
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  NT = Tp // C
  s = _specs(NT, K, V, reverse=False)
  head_specs, head_args = _head_args(s, alog, dtb)
  (q, k, v, g, beta, h0, rc, rr, *head_args), mat = _layout.match_vma(
      q, k, v, g, beta, h0, rc, rr, *head_args)
  out_shape = [_layout.out_struct((B, H, Tp, V), v.dtype, mat),
               _layout.out_struct((B, H, K, V), _f32, mat)]
  out_specs = [s["v"], s["state"]]
  if save_states:
    out_shape.append(_layout.out_struct((B, H, NT, K, V), _f32, mat))
    out_specs.append(s["chunk_state"])
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, scale=scale, save_states=save_states, fused=fused),
      grid=(B, H, NT),
      in_specs=[s["k"], s["k"], s["v"], s["k"], s["beta"], s["rc"], s["rr"], s["state"]]
      + head_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((K, V), _f32)],
      compiler_params=_PARAMS,
      interpret=_interpret_arg(interpret),
      cost_estimate=_cost(1, q, k, v, g, beta, h0, *out_shape),
      name="kda_fwd_tpu",
  )(q, k, v, g, beta, rc, rr, h0, *head_args)
  return outs if save_states else (*outs, None)


def _bwd_kernel(*refs, scale, fused):
  """With `fused`, recomputes the prepared inputs and returns gradients w.r.t. the raw ones."""
  n_in = 12 if fused.gate else 10
  (q_ref, k_ref, v_ref, g_ref, beta_ref, rc_ref, rr_ref, s0_ref, do_ref, dht_ref) = refs[:10]
  head_refs = refs[10:n_in]
  dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref, ds_scr = refs[n_in:]
  c = pl.program_id(2)  # counts chunks from the end

  @pl.when(c == 0)
  def _():
    ds_scr[...] = dht_ref[...]

  c_data = pl.num_programs(2) - 1 - c
  (q, k, g, beta), saved = _load(fused, c_data, q_ref, k_ref, g_ref, beta_ref, head_refs)
  dq, dk, dv, dg, dbeta, ds0 = cm.chunk_bwd(
      q, k, v_ref[...].astype(_f32), g, beta, rc_ref[...], rr_ref[...], s0_ref[...],
      do_ref[...].astype(_f32), ds_scr[...], scale, cm.RESHAPE_OPS)
  if fused.active:
    dq, dk, dg, dbeta = cm.raw_grads(fused, saved, dq, dk, dg, dbeta)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  dg_ref[...] = dg.astype(dg_ref.dtype)
  dbeta_ref[...] = dbeta
  ds_scr[...] = ds0

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    dh0_ref[...] = ds0


def _bwd_call(q, k, v, g, beta, rc, rr, alog, dtb, states, do, dht, *, scale, interpret,
              fused):
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  NT = Tp // C
  s = _specs(NT, K, V, reverse=True)
  head_specs, head_args = _head_args(s, alog, dtb)
  (q, k, v, g, beta, rc, rr, states, do, dht, *head_args), mat = _layout.match_vma(
      q, k, v, g, beta, rc, rr, states, do, dht, *head_args)
  return pl.pallas_call(
      functools.partial(_bwd_kernel, scale=scale, fused=fused),
      grid=(B, H, NT),
      in_specs=[s["k"], s["k"], s["v"], s["k"], s["beta"], s["rc"], s["rr"], s["chunk_state"],
                s["v"], s["state"]] + head_specs,
      out_specs=[s["k"], s["k"], s["v"], s["k"], s["beta"], s["state"]],
      out_shape=[_layout.out_struct(x.shape, x.dtype, mat) for x in (q, k, v, g, beta)]
      + [_layout.out_struct((B, H, K, V), _f32, mat)],
      scratch_shapes=[pltpu.VMEM((K, V), _f32)],
      compiler_params=_PARAMS,
      interpret=_interpret_arg(interpret),
      cost_estimate=_cost(3, q, k, v, g, beta, states, do, q, k, v, g, beta),
      name="kda_bwd_tpu",
  )(q, k, v, g, beta, rc, rr, states, do, dht, *head_args)


_kda_core = _wrapper.make_core(_fwd_call, _bwd_call)


def kda_tpu(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
            segment_ids=None, A_log=None, dt_bias=None, raw: RawInputs = PREPARED,
            interpret=False) -> tuple[jax.Array, jax.Array | None]:
  """KDA on TPU, with reference.naive_kda's contract and raw-input options. Differentiable in
  q, k, v, g, beta and initial_state (and A_log, dt_bias with a gate). `interpret=True` runs
  the kernels in Pallas TPU interpret mode on CPU.

  The raw-input options (docs/kernels.md#raw-inputs) gate="lower_bound" (K3),
  use_beta_sigmoid and use_qk_l2norm are prepared in-kernel in float32 as each chunk is loaded
  (the math of reference.prepare_inputs), and the backward kernel returns the raw inputs' gradients;
  gate="softplus" (Kimi-Linear) is prepared before the kernels, in jnp.
  """
  return _wrapper.kda_with(
      _kda_core, _layout.lane_multiple, q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, segment_ids=segment_ids, A_log=A_log,
      dt_bias=dt_bias, raw=raw, interpret=interpret, in_kernel=True)


def kda_step_tpu(q, k, v, g, beta, state, *, scale=None, interpret=False):
  """Fused single-token decode: q, k, g [B,H,K]; v [B,H,V]; beta [B,H]; state [B,H,K,V]
  float32 -> (o [B,H,V] in v's dtype, new state). The state is updated in place (aliased).

  One grid step handles up to 8 heads of one batch row; q/k/g arrive as columns [K,1] so they
  scale the state's rows without a relayout, and the step is pure VPU math in float32.
  """
  H = q.shape[1]
  return _wrapper.step_call(
      q, k, v, g, beta, state, scale=scale,
      heads=max(d for d in range(1, min(H, 8) + 1) if H % d == 0),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=_interpret_arg(interpret), name="kda_step_tpu")
