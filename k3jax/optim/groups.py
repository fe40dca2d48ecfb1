"""Which optimizer each parameter gets, read from its logical axis names
(docs/training.md#optimizer-groups).

Every `nnx.Param` of the model carries logical axis names in its `out_sharding` metadata
(vocabulary: sharding/rules.py). Per-Head Muon reads the same names, so the optimizer groups
follow the model's layout instead of a list of paths that would rot with every refactor:

  * batch axes `layers`, `experts`, `q_heads`, `kv_heads`: one orthogonalisation per entry
    (stacked layers, each routed expert, each attention head of a per-head projection);
  * a parameter is a Muon matrix iff it has >= 2 non-batch axes, no `vocab` axis, and at least
    one feature axis (`embed, q_lora, kv_lora, latent, gate_rank, mlp, moe_mlp`);
  * everything else (embedding, lm_head, norm gains, A_log, dt_bias, conv taps, AttnRes
    queries) goes to AdamW.

With exactly two non-batch axes the first is the input (reduction) side, the second the
output side. With more, the single feature axis is one side and the remaining non-batch axes,
flattened in order, the other (e.g. o_proj [heads, head_dim | embed], f_b [gate_rank | heads,
head_dim]); the side that comes first in the array is the reduction side. The orientation only
names fan_in / fan_out: the orthogonalisation and the sqrt(max(fan_in, fan_out)) scale are
symmetric in it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from sharding.rules import KNOWN_AXES

BATCH_AXES = frozenset({"layers", "experts", "q_heads", "kv_heads"})
FEATURE_AXES = frozenset({"embed", "q_lora", "kv_lora", "latent", "gate_rank", "mlp", "moe_mlp"})
MUON, ADAM = "muon", "adam"

Names = tuple[str | None, ...]
LogicalAxes = Any  # a pytree whose leaves are `Names`, or a callable(params) -> such a pytree


def is_names(x: Any) -> bool:
  """A leaf of a logical-axes tree: a tuple of axis names (None allowed, () for scalars)."""
  return (isinstance(x, tuple) and not isinstance(x, MuonDimensionNumbers)
          and all(n is None or isinstance(n, str) for n in x))


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def logical_axes_from_state(state: Any) -> Any:
  """Logical axis names of every parameter: `nnx.state(model, nnx.Param)` -> same tree of tuples.

  Only `nnx.Param` leaves are accepted. Other variable types (the router's bias, which Quantile
  Balancing sets, caches, batch stats) must never reach an optimizer, so they are refused here
  rather than silently given an optimizer state. A Param without `out_sharding` names is an
  error too: the names decide its optimizer group.
  """
  def names_of(path, v):
    where = jax.tree_util.keystr(path)
    if not isinstance(v, nnx.Param):
      raise ValueError(f"{where}: {type(v).__name__} is not an nnx.Param; only nnx.Param "
                       "leaves are optimizer parameters (filter with nnx.state(model, nnx.Param))")
    names = v.get_metadata().get("out_sharding")
    if names is None:
      raise ValueError(f"{where}: Param has no logical axis names (out_sharding metadata)")
    names = tuple(names)
    if len(names) != v.get_value().ndim:
      raise ValueError(f"{where}: names {names} do not match shape {v.get_value().shape}")
    return names

  return jax.tree_util.tree_map_with_path(names_of, state, is_leaf=_is_variable)


def resolve_logical_axes(logical_axes: LogicalAxes, params: Any) -> Any:
  """The names tree for `params`: call a callable, convert a State of Variables, check names."""
  axes = logical_axes(params) if callable(logical_axes) else logical_axes
  if any(_is_variable(x) for x in jax.tree.leaves(axes, is_leaf=_is_variable)):
    axes = logical_axes_from_state(axes)
  for names in jax.tree.leaves(axes, is_leaf=is_names):
    if not is_names(names):
      raise ValueError(f"logical axes leaf {names!r} is not a tuple of axis names")
    unknown = [n for n in names if n is not None and n not in KNOWN_AXES]
    if unknown:
      raise ValueError(f"unknown logical axis names {unknown} in {names} (see sharding/rules.py)")
  return axes


def dimension_numbers(names: Names) -> MuonDimensionNumbers | None:
  """How a parameter with these axis names is orthogonalised, or None for AdamW."""
  free = [i for i, n in enumerate(names) if n not in BATCH_AXES]
  if len(free) < 2 or "vocab" in names or not any(names[i] in FEATURE_AXES for i in free):
    return None
  if len(free) == 2:
    return MuonDimensionNumbers(reduction_axis=(free[0],), output_axis=(free[1],))
  features = [i for i in free if names[i] in FEATURE_AXES]
  if len(features) != 1:
    raise ValueError(f"{names}: a matrix with more than two non-batch axes needs exactly one "
                     f"feature axis ({sorted(FEATURE_AXES)}) to split it into two sides")
  side_a = tuple(features)
  side_b = tuple(i for i in free if i != features[0])
  if features[0] < side_b[0]:
    return MuonDimensionNumbers(reduction_axis=side_a, output_axis=side_b)
  return MuonDimensionNumbers(reduction_axis=side_b, output_axis=side_a)


def _map_names(fn: Callable[[Names], Any], axes: Any) -> Any:
  return jax.tree.map(fn, axes, is_leaf=is_names)


def param_labels(logical_axes: Any) -> Any:
  """Tree of "muon" / "adam" labels (for `optax.partition`)."""
  return _map_names(lambda n: MUON if dimension_numbers(n) is not None else ADAM, logical_axes)


def muon_weight_dimension_numbers(logical_axes: Any) -> Any:
  """Tree of `MuonDimensionNumbers` (Muon matrices) or None (AdamW).

  The format of `optax.contrib.muon(muon_weight_dimension_numbers=...)`, so the same grouping
  also drives optax's own Muon.
  """
  return _map_names(dimension_numbers, logical_axes)


def block_shape(shape: tuple[int, ...], dn: MuonDimensionNumbers) -> tuple[int, int, int]:
  """(number of blocks, fan_in, fan_out) of a parameter orthogonalised with `dn`."""
  prod = lambda axes: math.prod(shape[a] for a in axes)
  red, out = tuple(dn.reduction_axis), tuple(dn.output_axis)
  batch = tuple(a for a in range(len(shape)) if a not in red + out)
  return prod(batch), prod(red), prod(out)
