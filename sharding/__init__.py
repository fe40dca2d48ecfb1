"""Mesh axes, logical-axis rules and placement for k3jax (docs/sharding.md).

  rules.py        the one table: logical axis names -> mesh axes (parameters, activations)
  mesh.py         `make_mesh("data=2,expert=2,tensor=2", devices)`
  placement.py    shardings of parameters, optimizer state, batches; refusing a mesh that
                  cannot split the model
  activations.py  `constrain(x, names)`: activation constraints at layer boundaries
  distributed.py  multi-process start-up (`jax.distributed`) and per-process data rows
"""

from sharding.activations import constrain
from sharding.mesh import MeshError
from sharding.rules import MESH_AXES

__all__ = ["MESH_AXES", "MeshError", "constrain"]
