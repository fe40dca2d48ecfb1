"""Device meshes from a spec string (docs/sharding.md#mesh).

    data=2,fsdp=1,expert=2,tensor=2     axis sizes by name, in any order
    context=4,tensor=2                  a sequence's positions over 4 devices
    expert=4,tensor=2                   axes left out have size 1
    data=-1,tensor=2                    one axis may be -1: it takes the devices left over

The mesh always has the five axes of `rules.MESH_AXES`, in that order (size 1 allowed), so the
rules table and every layer see the same names whatever the spec. The product of the sizes
must equal the number of devices given: every device is used, and a typo never silently
leaves part of a slice idle.

`make_mesh(spec, devices)` builds it on any device list: `jax.devices()` (default; all
processes' devices in a multi-process run), fake CPU devices, a GPU host, a TPU slice, or the
devices of a TPU topology description (`jax.experimental.topologies.get_topology_desc`) for
ahead-of-time compilation without the hardware. It asks `jax.make_mesh` for a
topology-aware device order and falls back to the list's order where no such order exists.
All axes are `AxisType.Auto`: layers name logical axes and XLA's partitioner places the rest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from sharding.rules import MESH_AXES

_ENTRY = re.compile(r"^\s*([a-z]+)\s*=\s*(-?\d+)\s*$")


class MeshError(ValueError):
  """An impossible mesh or process layout: bad spec, wrong device count, a size the model
  cannot split, or inconsistent multi-process flags. The k3jax command line prints it as one
  line (sharding imports nothing of k3jax, so it has its own error type)."""


def parse_mesh_spec(spec: str) -> dict[str, int]:
  """'data=2,tensor=2' -> {'data': 2, 'tensor': 2} (sizes as written; -1 allowed once)."""
  sizes: dict[str, int] = {}
  if not spec or not spec.strip():
    raise MeshError("--mesh: empty spec (expected e.g. data=2,expert=2,tensor=2)")
  for part in spec.split(","):
    m = _ENTRY.match(part)
    if not m:
      raise MeshError(f"--mesh {spec!r}: {part.strip()!r} is not AXIS=SIZE "
                      f"(axes {', '.join(MESH_AXES)})")
    name, size = m.group(1), int(m.group(2))
    if name not in MESH_AXES:
      raise MeshError(f"--mesh {spec!r}: unknown axis {name!r} (axes {', '.join(MESH_AXES)})")
    if name in sizes:
      raise MeshError(f"--mesh {spec!r}: axis {name!r} given twice")
    if size == 0 or size < -1:
      raise MeshError(f"--mesh {spec!r}: {name}={size} (a size is >= 1, or -1 for the rest)")
    sizes[name] = size
  if sum(1 for s in sizes.values() if s == -1) > 1:
    raise MeshError(f"--mesh {spec!r}: at most one axis may be -1")
  return sizes


def axis_sizes(spec: str | Mapping[str, int], num_devices: int) -> dict[str, int]:
  """All five axis sizes, in MESH_AXES order, for `num_devices` devices."""
  given = parse_mesh_spec(spec) if isinstance(spec, str) else dict(spec)
  sizes = {ax: given.get(ax, 1) for ax in MESH_AXES}
  fixed = math.prod(s for s in sizes.values() if s != -1)
  text = format_sizes(given) if not isinstance(spec, str) else spec
  if -1 in sizes.values():
    if num_devices % fixed:
      raise MeshError(f"--mesh {text}: {num_devices} devices are not a multiple of {fixed}, "
                      "so -1 has no size")
    sizes = {ax: num_devices // fixed if s == -1 else s for ax, s in sizes.items()}
  elif fixed != num_devices:
    raise MeshError(f"--mesh {text} has {fixed} devices, but there are {num_devices}")
  return sizes


def format_sizes(sizes: Mapping[str, int]) -> str:
  return ",".join(f"{ax}={sizes[ax]}" for ax in MESH_AXES if ax in sizes)


def make_mesh(spec: str | Mapping[str, int],
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """The (data, fsdp, expert, context, tensor) mesh `spec` describes, over `devices` (default: every
  device of every process)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = axis_sizes(spec, len(devices))
  shape = tuple(sizes[ax] for ax in MESH_AXES)
  types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    # no topology-aware order for this shape (or a device kind mesh_utils does not know)
    return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
                             axis_types=types)


def describe(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> str:
  return f"{format_sizes(dict(mesh.shape))} ({mesh.size} devices)"
