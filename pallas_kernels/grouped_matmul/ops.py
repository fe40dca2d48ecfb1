"""The public grouped matmul of expert-sorted rows (the routed experts of a dropless MoE), with
its implementations in a table.

    grouped_matmul(x_mh, w_ehf, group_sizes_e, *, impl=None, precision=None, tile=TILE,
                   interpret=None) -> y_mf

Rows arrive sorted by expert, `group_sizes` [E] of them per expert: y[i] = x[i] @ w[expert of
row i] (reference.py, the definition). The groups may fill only a prefix of the rows (sum <= m,
as in the fixed-size buffers of expert parallelism): rows past the last group give zeros. The
implementations, equal to the reference up to float summation order:

  "ragged_dot"  ragged.py: jax.lax.ragged_dot, XLA's grouped matmul (GPU's default)
  "megablox"    megablox.py: JAX's Pallas TPU kernels, whose grid stops at the group sizes
                (TPU's default)
  "tiled"       tiled.py: groups padded to whole row tiles, one batched matmul (CPU's default)

Each takes the options that apply to it (`_IMPLS`): `precision` (not megablox: it multiplies in
the operands' dtype with float32 accumulation), `tile` (tiled), `interpret` (megablox).
"""

from __future__ import annotations

import jax

from pallas_kernels.grouped_matmul import megablox, ragged, tiled
from pallas_kernels.grouped_matmul.common import TILE
from pallas_kernels.grouped_matmul.megablox import SCOPE
from pallas_kernels.grouped_matmul.ragged import ROWS

ALIGN = 128  # a row count that every impl takes without a padded copy (ROWS and TILE divide it)
assert ALIGN % ROWS == 0 and ALIGN % TILE == 0

# name -> (function, the options it takes)
_IMPLS = {
    "ragged_dot": (ragged.grouped_matmul, ("precision",)),
    "megablox": (megablox.grouped_matmul, ("interpret",)),
    "tiled": (tiled.grouped_matmul, ("precision", "tile")),
}
IMPLS = tuple(_IMPLS)
__all__ = ["ALIGN", "IMPLS", "ROWS", "SCOPE", "TILE", "default_impl", "grouped_matmul"]


def default_impl() -> str:
  return {"cpu": "tiled", "tpu": "megablox"}.get(jax.default_backend(), "ragged_dot")


def grouped_matmul(x_mh: jax.Array, w_ehf: jax.Array, group_sizes_e: jax.Array, *,
                   impl: str | None = None, precision=None, tile: int = TILE,
                   interpret: bool | None = None) -> jax.Array:
  """y [m, F] = each row of x [m, H] times its expert's w [E, H, F]; impl=None: default_impl()
  (see the module docstring)."""
  impl = impl or default_impl()
  if impl not in _IMPLS:
    raise ValueError(f"unknown grouped matmul {impl!r}; expected one of {IMPLS}")
  fn, takes = _IMPLS[impl]
  options = dict(precision=precision, tile=tile, interpret=interpret)
  return fn(x_mh, w_ehf, group_sizes_e, **{name: options[name] for name in takes})
