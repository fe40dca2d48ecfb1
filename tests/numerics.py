"""Numerics shared by the tests: float64 truths and tolerances derived from float32 error growth.

docs/correctness.md: a float32 result is compared with a float64 truth (the same computation, or an
independent reference, run in float64 on the very same input values), never with a second
float32 computation whose summation order differs: two such runs can disagree by the sum of
both errors in a way that depends on the CPU's vector width and XLA's fusion choices.

The tolerances, each derived here once and cited where it is used (u = 2^-24 ~ 6e-8, float32's
unit roundoff):
  * `tolerance`: the 1e-5 bound, relative to the tensor's scale max(1, max|truth|). A float32
    result is a chain of roundings, each at most u times an intermediate value; where the
    intermediates are of the result's own magnitude (no cancelling sums: unit q/k, O(1) values
    and states in KDA), the error grows with that magnitude. Over the KDA grids it measured
    2-6 u of the tensor's max (1e-7 on O(1) outputs, 5e-6 on gradients of magnitude 20): 1e-5
    of the scale leaves a margin >= 10x on any machine; for O(1) tensors it is the plain 1e-5.
  * bf16 results: the float32 value rounded once more, off by at most half a bf16 ulp, 2^-8 of
    the magnitude, on top of the float32 error (rigorous, so the worst case sits near it).
  * `sum_tolerance`: a parameter gradient reduced over N per-token terms t (A_log's over
    batch, time and features). Summing N terms in float32 pairwise passes every term through
    ceil(log2 N) roundings of at most u times a partial sum <= sum|t|: error <= ceil(log2 N) u
    sum|t| (Higham, Accuracy and Stability of Numerical Algorithms, §4.2); the Pallas
    wrappers sum so. An order XLA picks (a running sum per vector lane) has a looser worst case
    but zero-mean, independent roundings: measured <= 0.9 u sum|t| at these sizes. The terms'
    own float32 errors (the per-token gradients, checked with `tolerance`) are zero-mean and
    add in quadrature: with the reduction, measured <= 1.1 u sum|t|. ATOL is added for sums of
    few terms.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

U32 = 2.0**-24  # float32 unit roundoff
ATOL = 1e-5
BF16_HALF_ULP = 2.0**-8


def to_float64(tree):
  """numpy float64 copies of every floating leaf (ints and bools kept)."""
  def cast(x):
    a = np.asarray(x)
    return a.astype(np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a
  return jax.tree.map(cast, tree)


def float64_truth(fn, *args, **kwargs):
  """fn(*args, **kwargs) in float64 (jax.enable_x64) on float64 copies of every floating array
  argument; returns numpy float64 results."""
  with jax.enable_x64(True):
    args, kwargs = jax.tree.map(lambda a: jnp.asarray(a), to_float64((args, kwargs)))
    out = fn(*args, **kwargs)
    return jax.tree.map(lambda x: np.asarray(x, np.float64), out)


def tolerance(want, atol=ATOL):
  """docs/correctness.md's float32 tolerance for the float64 truth `want`: atol times its scale."""
  want = np.asarray(want, np.float64)
  return atol * max(1.0, float(np.max(np.abs(want), initial=0.0)))


def tolerance_for(dtype, want, atol=ATOL):
  """`tolerance`, plus one rounding to bf16 for a bf16 result."""
  tol = tolerance(want, atol)
  if np.dtype(dtype) == jnp.bfloat16:
    tol = tol + BF16_HALF_ULP * np.abs(np.asarray(want, np.float64))
  return tol


def dot_tolerance(abs_dot, n):
  """A float32 dot product of length n, against its exact value: at most n u times the sum of
  the products' magnitudes (`abs_dot`, e.g. |x| @ |w|), rounding to nearest (Higham §3.1)."""
  return n * U32 * np.asarray(abs_dot, np.float64)


def sum_tolerance(terms, axis, atol=ATOL):
  """Tolerance for sum(terms, axis) computed in float32 (see the module docstring).

  terms: the per-element terms from the float64 truth, e.g. dL/dx (x + dt_bias) for dA_log.
  """
  terms = np.asarray(terms, np.float64)
  axis = tuple(np.atleast_1d(axis))
  n = math.prod(terms.shape[a] for a in axis)
  return atol + math.ceil(math.log2(max(n, 2))) * U32 * np.sum(np.abs(terms), axis=axis)


def assert_close(name, got, want, tol=None, *, atol=ATOL):
  """|got - want| <= tol elementwise: `got` a float32 (or bf16) result, `want` its float64
  truth, `tol` a scalar or an array broadcasting against want, by default
  `tolerance_for(got's dtype, want, atol)`. The one comparison every test uses."""
  got = np.asarray(got)
  if tol is None:
    tol = tolerance_for(got.dtype, want, atol)
  got, want = got.astype(np.float64), np.asarray(want).astype(np.float64)
  assert got.shape == want.shape, (name, got.shape, want.shape)
  tol = np.broadcast_to(np.asarray(tol, np.float64), want.shape)
  err = np.abs(got - want)
  if err.size == 0:
    return
  worst = np.unravel_index(np.argmax(err - tol), err.shape)
  assert np.all(err <= tol), (
      f"{name}: max |err| {err.max():.3e} (at {worst}: got {got[worst]:.7e} want "
      f"{want[worst]:.7e}, tol {tol[worst]:.2e})")
