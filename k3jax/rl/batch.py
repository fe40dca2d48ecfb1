"""Trajectories as a train batch: packed rows with segment ids, not padded to one length.

A trajectory of n ids takes n - 1 positions of a row (inputs ids[:-1], targets ids[1:]); rows
of `seq_len` positions take trajectories first-fit, longest first, each with its own segment id
(1, 2, ... in its row; 0 is padding), so the model's segment masks (MLA) and state resets (KDA)
keep them apart: a trajectory's logprobs are those it has alone. The loss covers the positions
whose target the policy sampled (observation and prompt tokens are masked out). Rows are a
power of two times the batch's divisor (`multiple`: grad_accum times the mesh's batch ways),
so a run compiles a few shapes. GSPO's sequence ratio needs a trajectory per row (`one_per_row`).

The token weights of the loss aggregation (objectives.token_weights) are a trajectory's, from
its own trained-token count, wherever its tokens are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from k3jax.engine.config import bucket
from k3jax.rl.objectives import LossAgg


@dataclasses.dataclass
class Batch:
  """Host arrays [rows, seq_len]; `where[i]` = (row, first position) of trajectory i, and
  `rollout_mask` every sampled token's position (trained or not: what the metrics cover)."""
  arrays: dict[str, np.ndarray]
  rollout_mask: np.ndarray
  where: list[tuple[int, int]]

  @property
  def rows(self) -> int:
    return self.rollout_mask.shape[0]

  @property
  def seq_len(self) -> int:
    return self.rollout_mask.shape[1]

  def per_token(self, trajectories, values: Sequence[Sequence[float]], dtype) -> np.ndarray:
    """[rows, seq_len] of per-trajectory arrays aligned with each one's targets (ids[1:])."""
    out = np.zeros(self.rollout_mask.shape, dtype)
    for (row, at), v in zip(self.where, values):
      out[row, at:at + len(v)] = v
    return out


def pack(lengths: Sequence[int], seq_len: int, one_per_row: bool = False) -> list[list[int]]:
  """Trajectory indices per row: first fit, longest first (positions: length - 1 each)."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  rows: list[list[int]] = []
  free: list[int] = []
  for i in order:
    need = lengths[i] - 1
    if need > seq_len:
      raise ValueError(f"a trajectory of {lengths[i]} ids does not fit {seq_len} positions")
    at = next((r for r, f in enumerate(free) if f >= need), None) if not one_per_row else None
    if at is None:
      rows.append([])
      free.append(seq_len)
      at = len(rows) - 1
    rows[at].append(i)
    free[at] -= need
  return rows


def row_count(needed: int, multiple: int, most: int) -> int:
  """Rows of a batch holding `needed`: a power of two times `multiple`, at most `most` (itself
  a multiple) unless more are needed."""
  return max(multiple * bucket(-(-max(needed, 1) // multiple), max(most // multiple, 1)),
             -(-needed // multiple) * multiple)


def trajectory_weights(trained: Sequence[int], agg: LossAgg, max_len: int) -> list[float]:
  """Each trajectory's weight per trained token (objectives.token_weights, per trajectory)."""
  n_seq = max(sum(1 for n in trained if n > 0), 1)
  total = max(sum(trained), 1)
  if agg == LossAgg.TOKEN_MEAN:
    return [1.0 / total] * len(trained)
  if agg == LossAgg.SEQUENCE_MEAN:
    return [1.0 / (max(n, 1) * n_seq) for n in trained]
  if agg == LossAgg.FIXED_LENGTH_SUM:
    return [1.0 / (float(max_len) * n_seq)] * len(trained)
  raise ValueError(f"unknown loss aggregation {agg!r}")


def build(trajectories, trains: Sequence[bool], advantages: Sequence[Sequence[float]],
          seq_len: int, multiple: int, most: int, agg: LossAgg, max_len: int, float_dtype,
          one_per_row: bool = False, fixed_rows: bool = False) -> Batch:
  """The packed batch of `trajectories` (driver.Trajectory: ids, sampled, logprobs, versions).
  `advantages[i]`: trajectory i's advantage per id (aligned with its ids; read at sampled
  ones); `trains[i]`: whether it is in the loss; `fixed_rows`: always `most` rows. Arrays:
  inputs, targets, segment_ids, loss_mask, old_logp (mu), advantages, weights, and `versions`
  (-1 off sampled tokens)."""
  layout = pack([len(t.ids) for t in trajectories], seq_len, one_per_row)
  n_rows = most if fixed_rows else row_count(len(layout), multiple, most)
  shape = (n_rows, seq_len)
  a = {"inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
       "segment_ids": np.zeros(shape, np.int32), "loss_mask": np.zeros(shape, bool),
       "old_logp": np.zeros(shape, float_dtype), "advantages": np.zeros(shape, float_dtype),
       "weights": np.zeros(shape, float_dtype), "versions": np.full(shape, -1, np.int32)}
  rollout = np.zeros(shape, bool)
  where = [(0, 0)] * len(trajectories)
  trained = [sum(t.sampled[1:]) if ok else 0 for t, ok in zip(trajectories, trains)]
  per_token = trajectory_weights(trained, agg, max_len)
  for row, members in enumerate(layout):
    at = 0
    for seg, i in enumerate(members, 1):
      t, n = trajectories[i], len(trajectories[i].ids) - 1
      span = slice(at, at + n)
      sampled = np.asarray(t.sampled[1:], bool)
      a["inputs"][row, span] = t.ids[:-1]
      a["targets"][row, span] = t.ids[1:]
      a["segment_ids"][row, span] = seg
      rollout[row, span] = sampled
      a["old_logp"][row, span] = np.where(sampled, t.logprobs[1:], 0.0)
      a["versions"][row, span] = np.where(sampled, t.versions[1:], -1)
      if trains[i]:
        a["loss_mask"][row, span] = sampled
        a["advantages"][row, span] = np.where(sampled, np.asarray(advantages[i])[1:], 0.0)
        a["weights"][row, span] = np.where(sampled, per_token[i], 0.0)
      where[i] = (row, at)
      at += n
  return Batch(a, rollout, where)
