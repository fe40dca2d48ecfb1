"""The host allocator under XLA:CPU: glibc malloc, or tcmalloc preloaded.

Why it matters on a CPU host: every execution of a jitted step allocates its temporaries
afresh, hundreds of MB for a ~100M-parameter train step. glibc malloc serves every block over
32 MiB (its largest mmap threshold) with a fresh mmap and returns it to the kernel on free, so
each step touches those pages for the first time again: every page fault zero-fills a page,
and the faults take a large share of a layer's time. tcmalloc keeps freed memory mapped for
the next step (benchmarks/train.py measures both: docs/benchmarks.md#train-step). The
allocator is chosen when the process starts (LD_PRELOAD), hence the re-exec below. On TPU and
GPU the step's buffers live in device memory and this does not apply.

    LD_PRELOAD=$(python -c "from k3jax import allocator; print(allocator.find_tcmalloc())") ...

Debian / Ubuntu: `apt-get install libtcmalloc-minimal4`.
"""

from __future__ import annotations

import os
import sys

TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
            "/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
OPT_OUT = "K3JAX_ALLOCATOR"  # "system": never re-exec under tcmalloc


def find_tcmalloc(dirs=LIB_DIRS) -> str | None:
  """The path of an installed tcmalloc shared library, or None."""
  for d in dirs:
    for name in TCMALLOC_NAMES:
      path = os.path.join(d, name)
      if os.path.isfile(path):
        return path
  return None


def active(maps_path: str = "/proc/self/maps") -> str:
  """"tcmalloc" if tcmalloc is mapped into this process, else "system"."""
  try:
    with open(maps_path) as f:
      return "tcmalloc" if "libtcmalloc" in f.read() else "system"
  except OSError:
    return "system"


def reexec_with_tcmalloc(argv: list[str], lib: str | None = None) -> None:
  """Replace this process by `python argv...` with tcmalloc (`lib`, default the installed one)
  preloaded, unless it is loaded already, none is installed, or K3JAX_ALLOCATOR is "system";
  returns when it does not re-exec. Call it first thing in a script's __main__."""
  if os.environ.get(OPT_OUT) == "system" or active() == "tcmalloc":
    return
  lib = lib or find_tcmalloc()
  if lib is None:
    return
  env = dict(os.environ)
  env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD")) if p)
  env[OPT_OUT] = "system"  # no second attempt if the preload does not take
  os.execve(sys.executable, [sys.executable, *argv], env)
