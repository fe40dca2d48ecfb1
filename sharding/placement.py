"""Where the model's arrays live on a mesh: parameters, router biases, optimizer state, batches.

Parameters: each variable's logical names (`out_sharding` metadata) and shape go through
`rules.logical_to_spec` (Flax's `linen.logical_to_mesh_axes` on the table's parameter column,
with the shape-dependent fallback rows). (`nnx.get_partition_spec` under
`nnx.logical_axis_rules` would map names one by one and give LatentMoE's routed_down
[embed, latent] the spec (fsdp, fsdp), which no sharding accepts; the linen rules engine uses
a mesh axis at most once per array, by rule priority.) Every "rules table -> NamedSharding" of
the code base is made here: the train state (`variable_shardings`), Orbax restore targets by
path (`path_shardings`, which `convert.load.named_shardings` returns), and models read into
host memory then placed (`place_model`: parity, generate). Optimizer state: every leaf that
mirrors a parameter (Muon momentum, AdamW moments: same key path suffix and shape) lives
exactly where that parameter lives, so the update of a block never moves it; counters and
other scalars are replicated. Batches [A, b, T]: rows over data x fsdp x expert (the
activation column of `batch`), positions over `context` (`length`'s).

`check_model_fits` refuses, before anything compiles, a mesh whose axes do not divide the
dimensions they would split (heads on `tensor`, experts on `expert`, widths on `fsdp`), naming
the first parameter that fails; `check_batch` does the same for rows per micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sharding.mesh import MeshError, describe
from sharding.rules import BATCH_MESH_AXES, CONTEXT_AXIS, axes_size, logical_to_spec


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _plain(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {k: _plain(v) for k, v in tree.items()}
  return tree


def variable_spec(var: nnx.Variable, mesh) -> PartitionSpec:
  """The parameter-column PartitionSpec of one variable on `mesh` (replicated without names;
  axes of size 1 dropped)."""
  names = var.get_metadata().get("out_sharding")
  if not names:
    return PartitionSpec()
  return logical_to_spec(tuple(names), mesh=mesh, shape=tuple(var.shape))


def variable_shardings(state: Any, mesh: jax.sharding.Mesh) -> Any:
  """nnx.State of (abstract) Variables carrying logical names -> nested dict of NamedSharding
  (the plain-dict layout of `nnx.as_pure(state)`)."""
  shardings = jax.tree.map(lambda v: NamedSharding(mesh, variable_spec(v, mesh)), state,
                           is_leaf=_is_var)
  return _plain(shardings)


def path_shardings(variables: Mapping[tuple[str, ...], nnx.Variable],
                   mesh: jax.sharding.Mesh) -> dict[tuple[str, ...], NamedSharding]:
  """{path: (abstract) Variable} -> {path: NamedSharding}, e.g. the restore targets of
  `convert.load.load_checkpoint` (refuses first a mesh that cannot split the model)."""
  check_model_fits(nnx.from_flat_state(dict(variables)), mesh)
  return {path: NamedSharding(mesh, variable_spec(var, mesh)) for path, var in variables.items()}


def place_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> None:
  """Move every variable of `model` (e.g. read into host memory from an official-layout
  folder) into its sharding on `mesh`, in place; refuses first a mesh that cannot split it."""
  state = nnx.state(model)
  check_model_fits(state, mesh)
  for _, var in nnx.to_flat_state(state):
    var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, variable_spec(var, mesh))))


def check_model_fits(state: Any, mesh: jax.sharding.Mesh) -> None:
  """MeshError naming the first variable one of whose dimensions its mesh axes do not divide."""
  mesh_shape = dict(mesh.shape)
  for path, var in nnx.to_flat_state(state):
    names = var.get_metadata().get("out_sharding") or ()
    for dim, (size, entry) in enumerate(zip(var.shape, tuple(variable_spec(var, mesh)))):
      ways = axes_size(entry, mesh_shape)
      if size % ways:
        axes = entry if isinstance(entry, str) else "x".join(entry)
        raise MeshError(
            f"--mesh {describe(mesh)}: {axes}={ways} does not divide "
            f"{names[dim] if dim < len(names) else 'dim ' + str(dim)}={size} of "
            f"{'.'.join(map(str, path))} {tuple(var.shape)}")


def like_params(tree: Any, params: Any, param_shardings: Any, mesh: jax.sharding.Mesh) -> Any:
  """Shardings for `tree` (e.g. an optimizer state, abstract or concrete): a leaf whose key path
  ends with a parameter's path and has its shape gets that parameter's sharding; anything else
  (step counters, scalars) is replicated."""
  by_path = {}
  for (path, p), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(param_shardings)):
    by_path[tuple(_key(k) for k in path)] = (tuple(p.shape), s)
  replicated = NamedSharding(mesh, PartitionSpec())

  def pick(path, leaf):
    keys = tuple(_key(k) for k in path)
    for start in range(len(keys) + 1):  # the empty suffix: a single-array "tree"
      hit = by_path.get(keys[start:])
      if hit is not None and hit[0] == tuple(getattr(leaf, "shape", ())):
        return hit[1]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, tree)


def _key(k) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def batch_rows_ways(mesh: jax.sharding.Mesh) -> int:
  return axes_size(BATCH_MESH_AXES, dict(mesh.shape))


def check_batch(rows: int, mesh: jax.sharding.Mesh, what: str = "rows per micro-batch") -> None:
  ways = batch_rows_ways(mesh)
  if rows % ways:
    raise MeshError(f"--mesh {describe(mesh)}: {what} = {rows} is not a multiple of "
                    f"data x fsdp x expert = {ways}")


def batch_sharding(mesh: jax.sharding.Mesh, leading: int = 1) -> NamedSharding:
  """[leading..., rows, T]: rows over data x fsdp x expert, positions over `context`."""
  return NamedSharding(mesh, PartitionSpec(*([None] * leading), BATCH_MESH_AXES, CONTEXT_AXIS))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
