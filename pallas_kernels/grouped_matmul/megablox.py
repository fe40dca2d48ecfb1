"""Grouped matmul on JAX's Pallas TPU kernels ("megablox"; the default on TPU):
jax.experimental.pallas.ops.tpu.megablox's gmm forward and for the input gradient, tgmm for
the weight gradient, under a custom_vjp of our own.

Its grid is sized at run time from the group sizes: it computes each group's rows rounded out to
whole row tiles (TILE), at most one shared tile per group boundary, and never the rows past the
last group. So the work done is the routed pairs, not the receive buffer that XLA's count (and
the kernel's cost estimate) assume; `k3jax plan` counts it so, finding the kernels by their
named scope SCOPE. A TPU kernel: lowered for a CPU (interpret=None, or True) it runs in Pallas's
interpret mode, slowly, which is how the tests run it. It multiplies in the operands' dtype
with float32 accumulation (a `precision` does not apply).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

# jax's private config for `_check_vma` (_call): no public switch turns the check off for one
# call; the flag is the one shard_map itself sets, and pyproject pins the libtpu of one jax release
from jax._src import config

from pallas_kernels.grouped_matmul.common import TILE, filled_rows, pad_rows
from pallas_kernels.vma import vary_like

SCOPE = "grouped_matmul"  # the named scope of megablox's kernels (plan finds them by it)


def grouped_matmul(x_mh: jax.Array, w_ehf: jax.Array, group_sizes_e: jax.Array, *,
                   interpret: bool | None = None) -> jax.Array:
  m = x_mh.shape[0]
  # one varying type for all three (inside shard_map): the casts stay outside the
  # custom_vjp, where autodiff transposes them (a replicated weight's gradient is summed)
  args = (pad_rows(x_mh, TILE), w_ehf.astype(x_mh.dtype), group_sizes_e.astype(jnp.int32))
  with jax.named_scope(SCOPE):
    y = _megablox(*(vary_like(a, *args) for a in args), interpret)
  return y[:m] if y.shape[0] != m else y


def _tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
  """Megablox's (rows, contraction, output) tiles: TILE rows (bounds the per-group rounding);
  a width of at most 512 whole (a block the size of its array dim is always legal), else the
  largest of 512 / 256 / 128 that divides it (megablox masks a ragged last tile otherwise)."""
  del m
  tile = lambda d: d if d <= 512 else next((t for t in (512, 256, 128) if d % t == 0), 512)
  return TILE, tile(k), tile(n)


def _below_groups(y_mf: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
  """Zeros in the rows past the last group: megablox's grid never visits them (their output
  memory is left unwritten)."""
  return jnp.where(filled_rows(y_mf.shape[0], group_sizes_e)[:, None], y_mf, 0)


def _kernels():
  """The megablox kernels' module (the package's `gmm` name is its custom_vjp wrapper, which
  leaves the rows past the last group unmasked)."""
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _call(kernel, *args, **kw):
  """A megablox kernel, also inside `jax.shard_map` (the expert-parallel body): its
  pallas_call gives its output no manual-axis type, which shard_map's check_vma refuses. It is
  traced with the check off and its result given the operands' varying mesh axes (one set:
  grouped_matmul casts them alike); each device computes its own values either way, and the
  kernel sits inside custom_vjp, so autodiff never transposes the cast."""
  varying = set().union(*(jax.typeof(a).mat.varying for a in args))
  interpret = kw.pop("interpret")
  with config._check_vma(False):
    if interpret is None:  # by the platform it is lowered for: TPU compiles it, CPU interprets
      out = jax.lax.platform_dependent(
          *args, cpu=functools.partial(kernel, **kw, interpret=True),
          default=functools.partial(kernel, **kw, interpret=False))
    else:
      out = kernel(*args, **kw, interpret=interpret)
  return jax.lax.pcast(out, tuple(sorted(varying)), to="varying") if varying else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _megablox(x_mh, w_ehf, group_sizes_e, interpret):
  y = _call(_kernels().gmm, x_mh, w_ehf, group_sizes_e, preferred_element_type=x_mh.dtype,
            tiling=_tiling, interpret=interpret)
  return _below_groups(y, group_sizes_e)


def _megablox_fwd(x_mh, w_ehf, group_sizes_e, interpret):
  return _megablox(x_mh, w_ehf, group_sizes_e, interpret), (x_mh, w_ehf, group_sizes_e)


def _megablox_bwd(interpret, res, dy_mf):
  mb = _kernels()
  x_mh, w_ehf, group_sizes_e = res
  dy_mf = dy_mf.astype(x_mh.dtype)
  # dx_i = dy_i W_g(i)^T; dW_g = sum over the group's rows of x_i^T dy_i (tgmm takes x^T)
  dx = _call(mb.gmm, dy_mf, w_ehf, group_sizes_e, preferred_element_type=x_mh.dtype,
             tiling=_tiling, transpose_rhs=True, interpret=interpret)
  dw = _call(mb.tgmm, x_mh.T, dy_mf, group_sizes_e, preferred_element_type=w_ehf.dtype,
             tiling=_tiling, interpret=interpret)
  return _below_groups(dx, group_sizes_e), dw, None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)
