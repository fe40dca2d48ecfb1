"""Collectives of a compiled program, read from its HLO text (for tests and benchmarks).

`collectives(compiled.as_text())` lists every all-gather / all-reduce / all-to-all /
ragged-all-to-all / collective-permute / reduce-scatter (async `-start` forms included) with the
bytes of its result on one device: the buffer the collective fills, a per-device measure that does
not depend on how the runtime routes it.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

from pallas_kernels.grouped_matmul import SCOPE

OPS = ("all-gather", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
       "reduce-scatter")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_LINE = re.compile(r"=\s*(.*?)\s+(" + "|".join(OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")


class Collective(NamedTuple):
  op: str
  result: str   # the result type as written, e.g. "f32[8,64,64]{2,1,0}" or a tuple
  bytes: int


def collectives(hlo_text: str) -> list[Collective]:
  out = []
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if m:
      result = m.group(1)
      size = sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
                 for dt, dims in _ARRAY.findall(result))
      out.append(Collective(m.group(2), result, size))
  return out


def summary(items: list[Collective]) -> dict[str, tuple[int, int]]:
  """op -> (count, bytes)."""
  out: dict[str, tuple[int, int]] = {}
  for c in items:
    n, b = out.get(c.op, (0, 0))
    out[c.op] = (n + 1, b + c.bytes)
  return out


# --- matmul FLOPs with loops counted by their trip counts ------------------------------------
#
# XLA's cost_analysis() counts the body of a while loop once, whatever its trip count (a
# lax.scan of 10 matmuls costs what one does), so for a scanned train step (layer units,
# micro-batches) it reports a fraction of the work. `matmul_flops` walks the optimized HLO
# instead: dots and convolutions (TPU writes its matmuls as convolutions) by their shapes,
# Pallas kernels by the cost estimate they carry, fusions and calls through the computations
# they call, the branches of a conditional by the largest, and a while loop's body times its
# trip count, read from its condition (`i < N` on a counter from 0, as lax.scan and fori_loop
# lower). Elementwise work is not counted: the figure is the matmul work the program does.

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_DIMS = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


Computations = dict[str, list[tuple[str, str, str, str]]]


def computations(hlo_text: str) -> tuple[Computations, str | None]:
  """({computation: [(name, type, opcode, args)]}, the entry computation's name)."""
  comps: Computations = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      current = comps.setdefault(m.group(1), [])
      entry = m.group(1) if line.startswith("ENTRY") else entry
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      typ, op, args = _split_type(m.group(2))
      current.append((m.group(1), typ, op, args))
  return comps, entry


def trip_count(comps: Computations, cond: str, args: str) -> int:
  """The trip count of a while loop (its condition `cond`, its own attributes `args`)."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', args)
  if known:  # XLA:CPU / GPU annotate it
    return int(known.group(1))
  # TPU: the condition compares the counter (from 0) with a constant, LT, maybe in a fusion
  body = comps.get(cond, ())
  called = [c for _, _, _, a in body for c in re.findall(r"calls=%([\w.\-]+)", a)]
  if not any(op == "compare" and "direction=LT" in a
             for c in (cond, *called) for _, _, op, a in comps.get(c, ())):
    return 1
  consts = [int(a.split(")")[0]) for _, typ, op, a in body
            if op == "constant" and typ.startswith("s32[]")]
  return max(consts, default=1)


def _split_type(rest: str) -> tuple[str, str, str]:
  """'TYPE opcode(args), attrs' -> (TYPE, opcode, the rest after 'opcode(')."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):  # noqa: B007 - i is read after the loop (where it broke)
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    typ, rest = rest[:i + 1], rest[i + 1:].lstrip()
  else:
    typ, _, rest = rest.partition(" ")
  op, _, args = rest.partition("(")
  return typ, op.strip(), args


def _shape(typ: str) -> list[int]:
  m = _DIMS.search(typ)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _operands(args: str) -> list[str]:
  return [o.split("#")[0] for o in re.findall(r"%([\w.\-#]+)", args.split(")")[0])]


def _window_taps(window: str, out_sizes: list[int], in_sizes: list[int]) -> float:
  """Sum over output positions of the window taps that land on a real input element, per
  spatial dimension, multiplied (base and window dilation, padding, stride)."""
  fields = dict(re.findall(r"(\w+)=([\dx_\-]+)", window))
  n = len(out_sizes)
  get = lambda key, default: ([int(v) for v in fields[key].split("x")] if key in fields
                              else [default] * n)
  size, stride = get("size", 1), get("stride", 1)
  lhs, rhs = get("lhs_dilate", 1), get("rhs_dilate", 1)
  pads = ([tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")]
          if "pad" in fields else [(0, 0)] * n)
  total = 1.0
  for d in range(n):
    span = (in_sizes[d] - 1) * lhs[d]
    k = np.arange(size[d], dtype=np.int64) * rhs[d] - pads[d][0]
    taps = 0
    # one output position at a time over all taps: XLA:TPU writes batched contractions as
    # base-dilated convolutions of 8192 x 8192 taps with one real input each (AttnRes on tpu7x)
    for o in range(out_sizes[d]):
      x = o * stride[d] + k
      taps += int(np.count_nonzero((x >= 0) & (x <= span) & (x % lhs[d] == 0)))
    total *= taps
  return total


def _conv_flops(out: list[int], lhs: list[int], rhs: list[int], attrs: str) -> float:
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
  if not labels:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  spatial = [c for c in out_l if c.isdigit()]
  window = re.search(r"window=\{([^}]*)\}", attrs)
  taps = _window_taps(window.group(1) if window else "",
                      [out[out_l.index(c)] for c in spatial],
                      [lhs[lhs_l.index(c)] for c in spatial]) if spatial else 1.0
  batch = out[out_l.index("b")] if "b" in out_l else 1
  return 2.0 * batch * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def matmul_flops(hlo_text: str, by_op: dict | None = None) -> float:
  """The matmul FLOPs of one run of the program in `hlo_text` (compiled.as_text(): one
  device's program), loops times their trip counts (see above). `by_op`, a dict, receives
  the same FLOPs by the JAX op each came from (its metadata op_name, without the jit(...)
  prefix)."""
  comps, entry = computations(hlo_text)
  shapes = {name: typ for body in comps.values() for name, typ, _, _ in body}
  memo: dict[str, float] = {}
  trips = lambda cond, args: trip_count(comps, cond, args)

  def cost(name: str, mult: float = 1.0, record: bool = True) -> float:
    """FLOPs of one run of computation `name`; with by_op (and `record`), attributed `mult`
    times."""
    if name in memo and (by_op is None or not record):
      return memo[name]
    total = 0.0
    for _, typ, op, args in comps.get(name, ()):
      before = total
      called = re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", args)
      if op == "dot":
        lhs = _shape(shapes.get(_operands(args)[0], ""))
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", args)
        k = math.prod(lhs[int(d)] for d in dims.group(1).split(",") if d) if dims else 1
        total += 2.0 * math.prod(_shape(typ)) * k
      elif op == "convolution":
        lhs, rhs = (_shape(shapes.get(o, "")) for o in _operands(args)[:2])
        total += _conv_flops(_shape(typ), lhs, rhs, args)
      elif op == "custom-call" and '"cost_estimate"' in args:
        f = re.search(r'"cost_estimate":\{[^}]*"flops":"(\d+)"', args)
        total += float(f.group(1)) if f else 0.0
      elif op == "while":
        body = re.search(r"body=%([\w.\-]+)", args).group(1)
        n = trips(re.search(r"condition=%([\w.\-]+)", args).group(1), args)
        total += n * cost(body, mult * n, record)
        continue
      elif op == "conditional":
        branches = re.findall(r"%([\w.\-]+)", args.split("branch_computations={")[1].split(
            "}")[0]) if "branch_computations={" in args else []
        costs = {b: cost(b, record=False) for b in branches}  # sizes only: nothing recorded
        if costs:
          widest = max(costs, key=costs.get)
          total += cost(widest, mult, record) if by_op is not None else costs[widest]
        continue
      elif op != "reduce" and called:  # fusion, call, async-start, map...
        total += sum(cost(c, mult, record) for c in called)
        continue
      if by_op is not None and record and total > before:
        where = re.search(r'op_name="(?:jit\([^)]*\)/)?([^"]*)"', args)
        key = where.group(1) if where else op
        by_op[key] = by_op.get(key, 0.0) + (total - before) * mult
    memo[name] = total
    return total

  return cost(entry) if entry else 0.0


def is_grouped_matmul(op_name: str) -> bool:
  """Whether a name in `matmul_flops`'s `by_op` is one of the routed experts' grouped matmuls:
  ragged_dot, or megablox's kernels (gmm, tgmm) under grouped_matmul's named scope."""
  return "ragged_dot" in op_name or (SCOPE in op_name and "pallas_call" in op_name)
