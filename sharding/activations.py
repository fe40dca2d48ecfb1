"""Activation sharding constraints at layer boundaries (docs/sharding.md#activations).

`constrain(x, ("batch", "length", "embed"))` maps logical names through the activation column
of the rules table and pins x there with `jax.lax.with_sharding_constraint`, under the context
mesh (`jax.set_mesh(mesh)`). Without a context mesh it returns x itself, so a model traced with
no mesh is the same program it always was. Inside `shard_map` (any manual axis) it is a no-op
too: there the layout is the caller's.

A dimension the mesh axes do not divide is split over the longest prefix of them that does
(e.g. a 2-row batch on data=2,expert=2 is split over `data` only); the train command refuses
such batch sizes before compiling, so this leniency only serves fixed-shape evaluation input.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from sharding.rules import ACTIVATION_RULES, fit_spec, logical_to_spec


def activation_spec(names: Sequence[str | None], shape: Sequence[int],
                    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh
                    ) -> jax.sharding.PartitionSpec:
  """The PartitionSpec of an activation of this shape and these logical names on `mesh`."""
  if len(names) != len(shape):
    raise ValueError(f"logical names {tuple(names)} for an array of shape {tuple(shape)}")
  spec = logical_to_spec(names, ACTIVATION_RULES, mesh=mesh)
  return fit_spec(spec, shape, dict(mesh.shape))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """x pinned to the placement of its logical axis names; a no-op without a context mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes:
    return x
  return pin(x, activation_spec(names, x.shape, mesh), mesh)


def pin(x: jax.Array, spec: jax.sharding.PartitionSpec,
        mesh: jax.sharding.AbstractMesh) -> jax.Array:
  """x placed as `spec` on the context mesh: resharded under explicit axes, else constrained."""
  if mesh.are_all_axes_explicit:
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)
