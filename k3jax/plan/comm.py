"""The bytes each device sends (and receives) per step in a compiled program's collectives, by
kind and by the mesh axes each runs over, loops counted by their trip counts
(docs/plan.md#communication).

Per collective, B = the bytes of its result on one device (all outputs of a combined one), n =
the devices of its group; what one device sends, as a ring or pairwise exchange moves it:

  all-gather          B (n-1)/n   (B: the gathered output)
  all-reduce          2 B (n-1)/n (a reduce-scatter, then an all-gather)
  reduce-scatter      B (n-1)     (its input is n B: n B (n-1)/n)
  all-to-all          B (n-1)/n   (the 1/n it keeps does not move)
  collective-permute  B
  ragged-all-to-all   B           (a bound: its output buffer, sized for the most it can receive)

The program is SPMD, so these are every device's bytes (a collective-permute's devices that are
in no pair send nothing: counted as if they did).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

from k3jax.plan.hlo import _ARRAY, _BYTES, OPS, computations, trip_count

_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_DONE = ("async-update", "async-done")  # their computation is the async-start's: counted there


class Traffic(NamedTuple):
  kind: str                # one of hlo.OPS
  axes: tuple[str, ...]    # the mesh axes its groups span
  bytes: float             # per device, per run of the program (trip counts included)


def _array_bytes(typ: str) -> int:
  return sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
             for dt, dims in _ARRAY.findall(typ))


def _top_level(typ: str) -> list[str]:
  """The elements of a tuple type '(a, (b, c), d)' -> ['a', '(b, c)', 'd']; an array: [it]."""
  if not typ.startswith("("):
    return [typ]
  out, depth, start = [], 0, 1
  for i, ch in enumerate(typ):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      out.append(typ[start:i].strip())
      start = i + 1
  return out


def _output_bytes(op: str, typ: str) -> int:
  """The bytes of a collective's outputs: async starts carry their operands (and, for a
  collective-permute, two u32 contexts) beside the output in their tuple."""
  if op in ("all-gather-start", "collective-permute-start") and typ.startswith("("):
    return _array_bytes(_top_level(typ)[1])
  return _array_bytes(typ)


def _axes_of(groups: list[list[int]], sizes: dict[str, int]) -> tuple[str, ...]:
  """The mesh axes along which the devices of a group differ (device id = its index in the
  mesh's devices, row-major)."""
  if not sizes:
    return ()
  shape = tuple(sizes.values())
  varying = set()
  for g in groups:
    coords = np.array(np.unravel_index(np.asarray(g), shape))
    varying |= {a for a, row in zip(sizes, coords, strict=True) if len(set(row)) > 1}
  return tuple(a for a in sizes if a in varying)


def _group(args: str, sizes: dict[str, int], devices: int) -> tuple[int, tuple[str, ...]]:
  """(devices per group, mesh axes) of a collective from its attributes."""
  m = _MESH_GROUPS.search(args)
  if m:  # replica_groups=mesh['a'=2,'b'=4] {'b'}: the axes by name; a sub-axis 'b':(p)k is the
    # k-sized middle of b's index split as [p, k, rest] (Shardy's axis splitting)
    mesh = {k.strip("' "): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))}
    named = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", m.group(2))
    dims, keep = [], []  # (axis, size) of the ids' axes after the splits; the kept ones
    for a, size in mesh.items():
      sub = next(((int(p), int(k)) for b, p, k in named if b == a and p), None)
      parts = [(a, size)] if sub is None else [(a, sub[0]), (a, sub[1]),
                                               (a, size // (sub[0] * sub[1]))]
      for i, part in enumerate(parts):
        if (sub is None and any(b == a for b, _, _ in named)) or (sub is not None and i == 1):
          keep.append(len(dims))
        dims.append(part)
    axes = [dims[i][0] for i in keep]
    n = math.prod(dims[i][1] for i in keep)
    if set(mesh) <= set(sizes) or not sizes:  # the plan's mesh: its axes (of size > 1) in
      return n, tuple(a for a, k in (sizes or mesh).items() if a in axes and k > 1)  # order
    # another mesh over the same devices (a shard_map's 'axis_0'...): its groups as ids
    ids = np.arange(math.prod(mesh.values())).reshape([k for _, k in dims])
    rest = [i for i in range(len(dims)) if i not in keep]
    groups = ids.transpose(rest + keep).reshape(-1, n).tolist()
    return n, _axes_of(groups, sizes)
  m = _IOTA.search(args)
  if m:  # replica_groups=[G,N]<=[dims]T(perm): an iota reshaped, transposed, cut in G groups
    gshape = [int(d) for d in m.group(1).split(",")]
    ids = np.arange(math.prod(gshape)).reshape([int(d) for d in m.group(2).split(",")])
    if m.group(3):
      ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    groups = ids.reshape(gshape[0], -1).tolist()
    return len(groups[0]), _axes_of(groups, sizes)
  m = _PAIRS.search(args)
  if m:
    pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return 2, _axes_of(pairs, sizes)
  m = _LIST.search(args)
  groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}",
                                                                     m.group(1))] if m else []
  groups = [g for g in groups if g]
  if not groups:  # replica_groups={} (or none): every device
    return devices, tuple(a for a, n in sizes.items() if n > 1)
  return len(groups[0]), _axes_of(groups, sizes)


def sent_bytes(kind: str, output: float, n: int) -> float:
  """Bytes one device sends in one collective of `kind` with `output` bytes of result over a
  group of `n` (the table above)."""
  if kind == "collective-permute":
    return float(output)
  if kind == "ragged-all-to-all":
    return float(output) if n > 1 else 0.0
  share = (n - 1) / n
  return {"all-gather": output * share, "all-reduce": 2 * output * share,
          "reduce-scatter": output * (n - 1), "all-to-all": output * share}[kind]


def traffic(hlo_text: str, sizes: dict[str, int] | None = None) -> list[Traffic]:
  """Every collective of one run of the compiled program in `hlo_text` (compiled.as_text()),
  as (kind, mesh axes, bytes per device), loops times their trip counts. `sizes`: the mesh's
  axis sizes in its order (mesh.shape), to name the axes of groups written as device ids."""
  sizes = dict(sizes or {})
  devices = int(m.group(1)) if (m := re.search(r"num_partitions=(\d+)", hlo_text)) else (
      math.prod(sizes.values()) if sizes else 1)
  comps, entry = computations(hlo_text)
  out: list[Traffic] = []

  def walk(name: str, mult: float, into: list[Traffic]) -> None:
    for _, typ, op, args in comps.get(name, ()):
      kind = op.removesuffix("-start")
      if kind in OPS and not op.endswith("-done"):
        n, axes = _group(args, sizes, devices)
        into.append(Traffic(kind, axes, mult * sent_bytes(kind, _output_bytes(op, typ), n)))
      elif op == "while":
        body = re.search(r"body=%([\w.\-]+)", args).group(1)
        cond = re.search(r"condition=%([\w.\-]+)", args).group(1)
        walk(body, mult * trip_count(comps, cond, args), into)
      elif op == "conditional" and "branch_computations={" in args:
        branches = re.findall(r"%([\w.\-]+)", args.split("branch_computations={")[1].split(
            "}")[0])
        runs = []
        for b in branches:  # the branch that moves the most
          runs.append([])
          walk(b, mult, runs[-1])
        into.extend(max(runs, key=lambda r: sum(t.bytes for t in r), default=[]))
      elif op not in _DONE:  # fusion, call, async-start...
        for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", args):
          walk(c, mult, into)

  if entry:
    walk(entry, 1.0, out)
  return out


def by_kind(items: list[Traffic]) -> dict[str, float]:
  """kind -> bytes per device, every kind (0 where the program has none)."""
  out = dict.fromkeys(OPS, 0.0)
  for t in items:
    out[t.kind] += t.bytes
  return out


def by_axis(items: list[Traffic]) -> dict[str, dict[str, float]]:
  """'axis' (or 'axis1,axis2' for a group over several) -> kind -> bytes per device."""
  out: dict[str, dict[str, float]] = {}
  for t in items:
    kinds = out.setdefault(",".join(t.axes) or "none", {})
    kinds[t.kind] = kinds.get(t.kind, 0.0) + t.bytes
  return out


