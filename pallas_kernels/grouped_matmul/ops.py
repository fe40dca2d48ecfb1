"""Grouped matmul of expert-sorted rows: y[i] = x[i] @ w[expert of row i] (dropless MoE).

    grouped_matmul(x_mh, w_ehf, group_sizes_e, impl=None) -> y_mf

Rows arrive sorted by expert, `group_sizes` [E] of them per expert. The groups may fill only
a prefix of the rows (sum <= m, as in the fixed-size buffers of expert parallelism): rows past
the last group give zeros. Three implementations, equal up to float summation order:

  "ragged_dot"  jax.lax.ragged_dot: XLA's grouped matmul (MXU / tensor-core kernels on TPU and
                GPU). XLA:CPU lowers it without tiling by group, far slower than a dense
                matmul of the same FLOPs (benchmarks/grouped_matmul.py measures it).
  "megablox"    JAX's Pallas TPU grouped matmul (jax.experimental.pallas.ops.tpu.megablox:
                gmm forward and for the input gradient, tgmm for the weight gradient). Its
                grid is sized at run time from the group sizes: it computes each group's rows
                rounded out to whole row tiles (TILE), at most one shared tile per group
                boundary, and never the rows past the last group. So the work done is the
                routed pairs, not the receive buffer that XLA's count (and the kernel's cost
                estimate) assume; `k3jax plan` counts it so (k3jax/plan/train.py). A TPU kernel:
                lowered for a CPU (interpret=None, or True) it runs in Pallas's interpret
                mode, slowly, which is how the tests run it. It multiplies in the
                operands' dtype with float32 accumulation (`precision` does not apply).
  "tiled"       every group is padded to a multiple of `tile` rows, so each tile of rows
                belongs to one expert; the tiles then run as one batched matmul against their
                experts' weights (gathered per tile). Static shapes: at most ceil(m / tile) + E
                tiles, so padding costs at most E * tile rows, and every tile is a plain
                matmul that XLA:CPU's dot emitter handles well.

impl=None picks "tiled" on CPU, "megablox" on TPU and "ragged_dot" elsewhere (GPU). With no more rows than experts
(decoding: batch x k rows), "tiled" instead gathers each row's expert matrix: a decode step
then reads only the k selected experts per token, not a padded tile of every expert.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from pallas_kernels.vma import vary_like

IMPLS = ("ragged_dot", "megablox", "tiled")
# ragged_dot's rows are padded to a multiple of this: XLA:TPU's ragged_dot kernel takes row
# counts that are multiples of 8, any other count a dense fallback that multiplies every row
# by every expert (E times the FLOPs). Callers that size their buffers (sharding/
# expert_parallel.py) align them already and pay no copy.
ROWS = 32
TILE = 128  # rows per tile; the padding waste (< E * TILE rows) buys fewer, larger matmuls
ALIGN = 128  # a row count that every impl takes without a padded copy (ROWS and TILE divide it)
SCOPE = "grouped_matmul"  # the named scope of megablox's kernels (plan finds them by it)


def default_impl() -> str:
  return {"cpu": "tiled", "tpu": "megablox"}.get(jax.default_backend(), "ragged_dot")


def grouped_matmul(x_mh: jax.Array, w_ehf: jax.Array, group_sizes_e: jax.Array, *,
                   impl: str | None = None, precision=None, tile: int = TILE,
                   interpret: bool | None = None) -> jax.Array:
  impl = impl or default_impl()
  if impl == "megablox":
    m = x_mh.shape[0]
    pad = -m % TILE  # megablox takes whole row tiles
    if pad:
      x_mh = jnp.pad(x_mh, ((0, pad), (0, 0)))
    # one varying type for all three (inside shard_map): the casts stay outside the
    # custom_vjp, where autodiff transposes them (a replicated weight's gradient is summed)
    args = (x_mh, w_ehf.astype(x_mh.dtype), group_sizes_e.astype(jnp.int32))
    with jax.named_scope(SCOPE):
      y = _megablox(*(vary_like(a, *args) for a in args), interpret)
    return y[:m] if pad else y
  if impl == "ragged_dot":
    m = x_mh.shape[0]
    pad = -m % ROWS
    if pad:  # (rows past the last group give zeros either way)
      x_mh = jnp.pad(x_mh, ((0, pad), (0, 0)))
    y = jax.lax.ragged_dot(x_mh, w_ehf, group_sizes_e, precision=precision)
    return y[:m] if pad else y
  if impl != "tiled":
    raise ValueError(f"unknown grouped matmul {impl!r}; expected one of {IMPLS}")
  m, e = x_mh.shape[0], w_ehf.shape[0]
  expert_m = jnp.repeat(jnp.arange(e), group_sizes_e, total_repeat_length=m)
  filled_m = jnp.arange(m) < jnp.sum(group_sizes_e)
  if m <= e:  # decode-sized: m expert matrices read, never more than the E + 1 tiles below
    y_mf = jnp.einsum("mh,mhf->mf", x_mh, w_ehf[expert_m], precision=precision)
    return jnp.where(filled_m[:, None], y_mf, 0)
  n_tiles = -(-m // tile) + e
  padded_e = (group_sizes_e + tile - 1) // tile * tile
  padded_end_e = jnp.cumsum(padded_e)
  start_e = jnp.cumsum(group_sizes_e) - group_sizes_e
  # row i of group g goes to (padded start of g) + (i - start of g); rows past the groups
  # go nowhere (an out-of-range position, dropped on write, read back as 0)
  pos_m = padded_end_e[expert_m] - padded_e[expert_m] + jnp.arange(m) - start_e[expert_m]
  pos_m = jnp.where(filled_m, pos_m, n_tiles * tile)
  x_pad = jnp.zeros((n_tiles * tile, x_mh.shape[1]), x_mh.dtype).at[pos_m].set(
      x_mh, mode="drop", unique_indices=True)
  # tiles past the last group hold only zeros; any expert index will do for them
  expert_j = jnp.minimum(
      jnp.searchsorted(padded_end_e, jnp.arange(n_tiles) * tile, side="right"), e - 1)
  y_jtf = jnp.einsum("jth,jhf->jtf", x_pad.reshape(n_tiles, tile, -1), w_ehf[expert_j],
                     precision=precision)
  return y_jtf.reshape(n_tiles * tile, -1).at[pos_m].get(mode="fill", fill_value=0)


def _tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
  """Megablox's (rows, contraction, output) tiles: TILE rows (bounds the per-group rounding);
  a width of at most 512 whole (a block the size of its array dim is always legal), else the
  largest of 512 / 256 / 128 that divides it (megablox masks a ragged last tile otherwise)."""
  del m
  tile = lambda d: d if d <= 512 else next((t for t in (512, 256, 128) if d % t == 0), 512)  # noqa: E731
  return TILE, tile(k), tile(n)


def _below_groups(y_mf: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
  """Zeros in the rows past the last group: megablox's grid never visits them (their output
  memory is left unwritten)."""
  live = jnp.arange(y_mf.shape[0]) < jnp.sum(group_sizes_e)
  return jnp.where(live[:, None], y_mf, 0)


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
  # (no public switch for one call; the private flag is the one shard_map itself sets, and
  # pyproject pins the libtpu of one jax release)
  from jax._src import config  # noqa: PLC0415
  varying = set().union(*(jax.typeof(a).mat.varying for a in args))
  interpret = kw.pop("interpret")
  with config._check_vma(False):  # noqa: SLF001
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
