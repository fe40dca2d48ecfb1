"""Where a run's numbers go: `OUT/metrics.jsonl` (one JSON object per logged step), TensorBoard
event files under `OUT/tb` (tensorboardX: no TensorFlow needed), and the console (tqdm).

A record holds `step` and `loss` always, and as available: grad_norm, lr, tokens_per_s, mfu,
step_time_s, eval_loss, and per MoE layer (lists, layer order) load_max_mean_before/after
(max expert load / mean load) and dead_before/after (fraction of experts with no token), and
per MLA layer mla_max_logit (largest pre-softmax logit, what QK-clip watches).

On resume the JSONL keeps only the records up to the restored step (the steps after it are
recomputed), and TensorBoard purges the events after it (`purge_step`), so neither shows a
curve twice.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"


def to_python(value: Any) -> Any:
  """Arrays and numpy scalars -> JSON values (lists for per-layer vectors)."""
  a = np.asarray(value)
  if a.ndim == 0:
    v = a.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v
  return [to_python(x) for x in a]


def read_records(out_dir: str) -> list[dict]:
  path = os.path.join(out_dir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
  def __init__(self, out_dir: str, *, resume_step: int | None, tensorboard: bool = True):
    self.path = os.path.join(out_dir, METRICS_FILE)
    kept = [r for r in read_records(out_dir)
            if resume_step is not None and r.get("step", 0) <= resume_step]
    with open(self.path, "w") as f:  # rewrite: drop records a resumed run recomputes
      for r in kept:
        f.write(json.dumps(r) + "\n")
    self._file = open(self.path, "a", buffering=1)  # line-buffered: a killed run keeps its lines
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 - slow import; only runs that log TensorBoard need it
      self._tb = SummaryWriter(os.path.join(out_dir, "tb"),
                               purge_step=None if resume_step is None else resume_step + 1)

  def write(self, record: dict[str, Any]) -> None:
    record = {k: to_python(v) for k, v in record.items()}
    self._file.write(json.dumps(record) + "\n")
    if self._tb is not None:
      step = record["step"]
      for key, value in record.items():
        if key == "step" or value is None:
          continue
        if isinstance(value, list):
          for i, v in enumerate(value):
            if v is not None:
              self._tb.add_scalar(f"{key}/layer_{i}", v, step)
        else:
          self._tb.add_scalar(key, value, step)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()
