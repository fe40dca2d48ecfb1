"""The start of a run's process (train, rl): the persistent compilation cache, the processes
joined (sharding/distributed.py), the mesh, the output folder and the path options made
absolute as a run records them.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from k3jax.errors import UserError
from sharding import distributed
from sharding.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class Started:
  opts: object                  # the options, their path options absolute
  out: str                      # OUT, absolute
  mesh: jax.sharding.Mesh | None
  main_process: bool            # process 0: writes run.json, metrics, TensorBoard, plots


def use_compile_cache(folder: str | None) -> None:
  """JAX's persistent compilation cache in `folder` (None: as JAX is configured)."""
  if folder:
    jax.config.update("jax_compilation_cache_dir", folder)


def start(opts, paths: dict) -> Started:
  """Join the run's processes (--coordinator, --num-processes, --process-id; Cloud TPU's
  environment) and build its mesh; `paths`: option -> how the run records it (absolute)."""
  use_compile_cache(opts.compile_cache)
  distributed.initialize(opts.coordinator, opts.num_processes, opts.process_id)
  if jax.process_count() > 1 and not opts.mesh:
    raise UserError(f"{jax.process_count()} processes need --mesh (e.g. data=-1)")
  mesh = make_mesh(opts.mesh) if opts.mesh else None
  opts = dataclasses.replace(opts, **{k: fn(getattr(opts, k)) for k, fn in paths.items()})
  return Started(opts, os.path.abspath(opts.out), mesh, distributed.is_main_process())
