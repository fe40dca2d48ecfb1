"""Collectives of a compiled program, read from its HLO text (for tests and benchmarks).

`collectives(compiled.as_text())` lists every all-gather / all-reduce / all-to-all /
ragged-all-to-all / collective-permute / reduce-scatter (async `-start` forms included) with the bytes of its
result on one device: the buffer the collective fills, a per-device measure that does not
depend on how the runtime routes it.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

OPS = ("all-gather", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
       "reduce-scatter")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_LINE = re.compile(r"=\s*(.*?)\s+(%s)(-start)?\(" % "|".join(OPS))
_ARRAY = re.compile(r"\b(%s)\[([\d,]*)\]" % "|".join(_BYTES))


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
