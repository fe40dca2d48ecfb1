"""The start of a run's process (train, rl): the persistent compilation cache, the processes
joined (sharding/distributed.py), the mesh, the output folder and the path options made
absolute as a run records them.
"""

from __future__ import annotations

import dataclasses
import os
import sys

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


def use_compile_cache(folder: str | None) -> bool:
  """JAX's persistent compilation cache in `folder` (None: as JAX is configured), unless the
  run's processes would not all find the same entries: then off for this process (False).

  JAX writes cache entries from process 0 only and keys each entry by the compile options and
  the devices; on CPU those differ between processes (each hashes its own devices), so over a
  warm cache process 0 runs executables deserialised from its earlier run while every other
  process compiles its own. That mix hung the first step of two-process CPU runs in about 1
  start in 3 (docs/sharding.md#multi-host); a multi-process CPU run therefore compiles on every
  process. On TPU and GPU the processes' keys agree (JAX strips what is per process) and every
  process reads the entries process 0 wrote."""
  if jax.process_count() > 1 and jax.default_backend() == "cpu":
    jax.config.update("jax_enable_compilation_cache", False)
    return False
  if folder:
    jax.config.update("jax_compilation_cache_dir", folder)
  return True


def start(opts, paths: dict) -> Started:
  """Join the run's processes (--coordinator, --num-processes, --process-id; Cloud TPU's
  environment), choose its compilation cache and build its mesh; `paths`: option -> how the
  run records it (absolute)."""
  distributed.initialize(opts.coordinator, opts.num_processes, opts.process_id)
  if not use_compile_cache(opts.compile_cache) and opts.compile_cache:
    if distributed.is_main_process():
      print(f"k3jax: --compile-cache {opts.compile_cache} is not used by a "
            f"{jax.process_count()}-process CPU run (each process compiles: on CPU only "
            "process 0 would find its programs there)", file=sys.stderr, flush=True)
  if jax.process_count() > 1 and not opts.mesh:
    raise UserError(f"{jax.process_count()} processes need --mesh (e.g. data=-1)")
  mesh = make_mesh(opts.mesh) if opts.mesh else None
  opts = dataclasses.replace(opts, **{k: fn(getattr(opts, k)) for k, fn in paths.items()})
  return Started(opts, os.path.abspath(opts.out), mesh, distributed.is_main_process())
