"""Where a compiled program's HBM goes: XLA's buffer assignment read back from a dump.

Compile with `XLA_FLAGS=--xla_dump_to=DIR` (e.g. `k3jax plan ...`; the TPU compiler writes
the files for a program it refuses too), then

    python benchmarks/xla_heap.py DIR [--module jit_train] [--top 25]
    (or python -m k3jax.plan.xla_heap ...)

prints, for the module's preallocated temporaries (one heap, every temporary at a fixed
offset for the whole program):

  heap      the heap's size: what the compiler asks HBM for on top of the arguments;
  max live  the most bytes of temporaries alive at one point of the schedule, and which
            values they are (name, shape, live range, the op that made them);
  packing   heap / max live: above 1 the heap has holes, values that outlive others
            pinned at offsets that the rest must pack around.

A memory change is judged by both numbers: max live says what the program holds, heap what
the compiler's packing of it costs. Reads only text files; nothing is compiled.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

GIB = 1024**3
_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$", re.M)


def _one(pattern: str) -> str:
  files = sorted(glob.glob(pattern))
  if not files:
    raise SystemExit(f"xla_heap: no file matches {pattern}")
  return files[-1]  # the last module of that name (the one compiled last)


def read(directory: str, module: str):
  """(values [(name, size, offset, shape)], ranges {name: (start, end)}, parameter bytes)."""
  stem = os.path.join(directory, f"*{module}*after_optimizations")
  assignment = open(_one(stem + "-buffer-assignment.txt")).read()
  live = open(_one(stem + "-live-range.txt")).read()
  # the temporaries' heap in the default memory space (others carry a "color": SparseCore,
  # VMEM, ...)
  heaps = list(re.finditer(r"^allocation \d+: size (\d+), (color \d+, )?page \d+, "
                           r"preallocated-temp:", assignment, re.M))
  heaps = [m for m in heaps if not m.group(2)] or heaps
  if not heaps:
    raise SystemExit("xla_heap: no preallocated-temp allocation in the buffer assignment")
  at = max(heaps, key=lambda m: int(m.group(1))).end()
  end = assignment.find("\nallocation", at)
  values = []
  for m in _VALUE.finditer(assignment[at:end if end > 0 else None]):
    name = m.group(1) if m.group(1).endswith("}") else m.group(1) + "{}"
    values.append((name, int(m.group(2)), int(m.group(3)), m.group(4)))
  section = live[live.index("BufferLiveRange:"):]
  ranges = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(section)}
  params = sum(int(m.group(1)) for m in re.finditer(
      r"^allocation \d+: size (\d+), [^\n]*parameter", assignment, re.M))
  return values, ranges, params


def summarize(directory: str, module: str) -> dict:
  """{arguments, heap, max_live: bytes; peak_step: schedule position; at_peak: the values
  alive there [(name, size, offset, shape, (start, end))], largest first; unranged: values
  without a live range}."""
  values, ranges, params = read(directory, module)
  timed = [(n, s, o, sh, ranges[n]) for n, s, o, sh in values if n in ranges]
  if not timed:
    raise SystemExit("xla_heap: no value of the heap has a live range")
  steps = max(e for *_, (_, e) in timed) + 2
  delta = [0] * (steps + 1)
  for _, size, _, _, (s, e) in timed:
    delta[s] += size
    delta[e + 1] -= size
  live, running, peak_t = [], 0, 0
  for t in range(steps):
    running += delta[t]
    live.append(running)
    if running > live[peak_t]:
      peak_t = t
  at_peak = sorted((v for v in timed if v[4][0] <= peak_t <= v[4][1]), key=lambda v: -v[1])
  return {"arguments": params, "heap": max(o + s for _, s, o, _, _ in timed),
          "max_live": live[peak_t], "peak_step": peak_t, "steps": steps - 2,
          "at_peak": at_peak, "values": len(values), "unranged": len(values) - len(timed)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("directory")
  p.add_argument("--module", default="jit_train", help="module name part (jit_train, ...)")
  p.add_argument("--top", type=int, default=25, help="values listed at the peak")
  args = p.parse_args()
  r = summarize(args.directory, args.module)
  print(f"{args.module}: {r['values']} values in the temporaries' heap, {r['unranged']} "
        "without a live range")
  print(f"  arguments {r['arguments'] / GIB:8.2f} GiB   heap {r['heap'] / GIB:8.2f} GiB   "
        f"max live {r['max_live'] / GIB:8.2f} GiB (at {r['peak_step']} of {r['steps']})   "
        f"packing {r['heap'] / max(r['max_live'], 1):.2f}x")
  print(f"  largest values alive at the peak (of {len(r['at_peak'])}):")
  for name, size, offset, shape, (s, e) in r["at_peak"][:args.top]:
    print(f"    {size / GIB:7.3f} GiB  @{offset / GIB:7.2f}  {s:>6}-{e:<6} {name:40s} {shape[:70]}")


if __name__ == "__main__":
  sys.exit(main())
