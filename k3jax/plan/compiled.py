"""What XLA says of a program compiled for TPU ahead of time: its memory, its cost analysis, or
the compile-time HBM refusal's figure when the TPU compiler will not build it."""

from __future__ import annotations

import re

_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\)")


def oom_temporaries(message: str) -> float | None:
  """The bytes in XLA's compile-time HBM OOM message ('... the total memory required for HLO
  temporaries (33.54G) exceeds available HBM (15.75G)'), None for any other error. Despite the
  wording the figure is the whole program's HBM: the arguments' buffers plus the temporaries'
  heap (in the buffer assignment that XLA_FLAGS=--xla_dump_to writes for the refused
  program, the parameter allocations and the preallocated temporaries sum to it:
  docs/plan.md#what-got-it-there)."""
  m = _OOM.search(message)
  if not m:
    return None
  return float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")


def compile_or_refusal(lowered):
  """`lowered.compile()`, or the bytes the TPU compiler's HBM refusal names (`oom_temporaries`:
  the arguments included) when it refuses the program for not fitting; any other error
  raises."""
  try:
    # (neither xla_tpu_max_hbm_size_mib above the chip's HBM nor xla_tpu_no_crash_on_oom
    # helps: the first is ignored, the second searches for a fitting schedule for > 10 min)
    return lowered.compile()
  except Exception as e:  # XLA's compile-time HBM check: JaxRuntimeError
    total = oom_temporaries(str(e))
    if total is None:
      raise
    return total


def peak_bytes(memory) -> float:
  """A compiled program's peak HBM per device from its memory_analysis(): XLA's own figure
  when it gives one, else arguments + outputs - aliased (donated) + temporaries."""
  return getattr(memory, "peak_memory_in_bytes", 0) or (
      memory.argument_size_in_bytes + memory.output_size_in_bytes
      - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def cost_analysis(compiled) -> dict:
  """The per-device program's cost_analysis() (one dict; some versions return a list of one)."""
  cost = compiled.cost_analysis()
  return cost[0] if isinstance(cost, (list, tuple)) else cost
