"""`k3jax plan`: will a step fit a TPU pod, on which mesh, how fast (docs/plan.md).

`run(PlanRequest(...))` plans any mode: the train step and LoRA fine-tuning (train.py), serving
(decode.py), LoRA RL's train state beside the engine's cache (rl.py); each returns one plan per
mesh tried, with `to_json()` and `report()`; `best` picks the one to report. The modules beside
them: chips.py (the chip table), analytic.py (the hand counts), hlo.py (matmul FLOPs and
collectives of compiled HLO), comm.py (the bytes each device sends in those collectives, by kind
and mesh axis), compiled.py (XLA's memory and cost analysis), search.py (the mesh search),
memory.py (fine-tuning state, LoRA vs full), xla_heap.py (the buffer assignment of a dump).
"""

from __future__ import annotations

import configs
from k3jax.plan import decode, rl, train
from k3jax.plan.chips import CHIPS, Chip, chip_of, topology_devices
from k3jax.plan.decode import DecodePlan
from k3jax.plan.request import Mode, PlanRequest
from k3jax.plan.rl import RlPlan
from k3jax.plan.search import best
from k3jax.plan.train import TrainPlan

Plan = TrainPlan | DecodePlan | RlPlan
DEFAULT_TOKENS_PER_DEVICE = 8192  # a train plan's default batch, per device
_RUN = {Mode.TRAIN: train.run, Mode.LORA: train.run, Mode.DECODE: decode.run,
        Mode.RL: rl.run}


def run(request: PlanRequest) -> list[Plan]:
  """The plans `request` asks for: its mesh's alone, or (without one) the candidates it
  searched (analytic) or compiled. Without a batch, one row per device (every mesh's batch
  axes divide it); for training at sequences longer than 8,192 positions, the rows that hold
  as many tokens (a row of 8,192 per device), at least one."""
  cfg = configs.resolve(request.config)
  devices = topology_devices(request.topology)
  if request.batch is None:
    rows = len(devices)
    if request.mode in (Mode.TRAIN, Mode.LORA) and request.seq > DEFAULT_TOKENS_PER_DEVICE:
      rows = max(1, rows * DEFAULT_TOKENS_PER_DEVICE // request.seq)
    request = request.replace(batch=rows)
  return _RUN[request.mode](request, cfg, devices)


__all__ = ["CHIPS", "Chip", "DecodePlan", "Mode", "Plan", "PlanRequest", "RlPlan", "TrainPlan",
           "best", "chip_of", "run", "topology_devices"]
