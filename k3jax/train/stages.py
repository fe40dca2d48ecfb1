"""Stages of a training run: a resume with `--new-stage` may change the sequence length, the
batch size, the data and the schedule, and carries on with the same parameters, optimizer
state and step (docs/training.md#a-pod-run-step-by-step).

OUT/run.json keeps the list of stages: {"stage": i, "start_step": the step it started after,
"options": its STAGE_KEYS and SCHEDULE_KEYS, "data_offsets": {data shard: pieces}, "sources":
{source: position}} (prepared data: below). Without --new-stage a resume must keep the
STAGE_KEYS and the prepared data's identity (one line naming the first that changed); with it,
something must change.

Data position. A source's position is how far its pipeline went in epochs (pieces consumed /
pieces per epoch, per data shard): a quantity that does not depend on the sequence length or
the batch, so a source present in both stages continues at the same position of its next
epochs and a source new to the stage starts at 0. The new stage's pipeline of a continuing
source starts its shuffled piece stream at round(position x its own pieces per epoch)
(`data_offsets`), the stream every data pipeline of the run reads from.

Prepared data (`--data DIR` of k3jax prepare-data, `--data-mix`). A component is identified by
its manifest fingerprint, not its path (a folder prepared again is a new component). A data
shard's saved position counts the documents each component's stream had given it
("consumed", k3jax/train/prepared_data.py); a component present in both stages continues its
own stream (the same per-epoch shuffles, `streams`: the seed slot it had) at that count, in
each data shard, and one new to the stage starts at 0 on a slot no other component uses. The
stage records "data_offsets": {data shard: {fingerprint: documents}}, "streams":
{fingerprint: slot} and "sources": {folder: {"fingerprint", "documents": {data shard: n}}} of
the continuing components. Counts are per data shard, and data shards are a property of the
run, so the position is the same on any number of processes. A group of documents the old
stage had begun handing out is counted as not consumed: the new stage reads it again whole.
"""

from __future__ import annotations

from typing import Any

from k3jax.errors import UserError
from k3jax.run.resume import saved_option

# what a new stage may change (and a plain resume may not)
STAGE_KEYS = ("data", "data_mix", "data_format", "seq_len", "batch_size")
# what a resume may always change; with STAGE_KEYS, what makes a stage new
SCHEDULE_KEYS = ("learning_rate", "adam_learning_rate", "warmup_steps", "decay_steps",
                 "end_lr_ratio", "schedule", "decay_frac", "grad_accum")
STDLIB = "<stdlib>"  # the source of a run without --data


def source_of(opts) -> str:
  """The data source a run reads (its --data, absolute; the stdlib sources without one)."""
  return opts.data or STDLIB


def options_of(opts) -> dict:
  return {k: getattr(opts, k) for k in (*STAGE_KEYS, *SCHEDULE_KEYS)}


def check_stage(out: str, saved: dict | None, opts, paths: dict,
                data_changed: bool = False) -> dict:
  """The STAGE_KEYS and SCHEDULE_KEYS that differ from the stage the run in `out` is in, as
  {key: (was, now)}; refuses in one line a STAGE_KEYS change without --new-stage, --new-stage
  with nothing changed (`data_changed`: the prepared data's identity differs, a change), and
  --new-stage with no run to continue."""
  if saved is None:
    if opts.new_stage:
      raise UserError(f"--new-stage: {out} holds no run to continue")
    return {}
  changed = {}
  for key in (*STAGE_KEYS, *SCHEDULE_KEYS):
    was, now = saved_option(saved, opts, key, paths), getattr(opts, key)
    if was != (list(now) if isinstance(now, tuple) else now):
      changed[key] = (was, now)
  if not opts.new_stage:
    for key in STAGE_KEYS:
      if key in changed:
        was, now = changed[key]
        raise UserError(f"{out} holds a run with --{key.replace('_', '-')} {was!r} (now "
                        f"{now!r}); resuming must keep it: start a new stage with --new-stage, "
                        "or use a new --out")
  elif not changed and not data_changed:
    raise UserError(f"--new-stage: nothing differs from the stage the run in {out} is in; "
                    "change --seq-len, --batch-size, --data, --data-mix or the schedule, or "
                    "resume "
                    "without --new-stage")
  return changed


def stages(saved: dict | None, opts) -> list[dict]:
  """The stages a run file records (a run before stages: one, from step 0)."""
  if saved is None:
    return [{"stage": 0, "start_step": 0, "options": options_of(opts), "data_offsets": {},
             "sources": {}}]
  return list(saved.get("stages") or [{"stage": 0, "start_step": 0,
                                       "options": dict(saved["options"]), "data_offsets": {},
                                       "sources": {}}])


def new_stage(previous: list[dict], start_step: int, opts, positions: dict[str, Any],
              offsets: dict[int, Any], streams: dict[str, int] | None = None) -> list[dict]:
  """The stages with a new one starting after `start_step`: its options, the positions the
  sources present in both stages continue from, its pipelines' offsets (prepared data: and
  its components' stream slots)."""
  stage = {"stage": len(previous), "start_step": start_step, "options": options_of(opts),
           "data_offsets": {str(k): v for k, v in offsets.items()}, "sources": positions}
  if streams is not None:
    stage["streams"] = streams
  return [*previous, stage]


def prepared_starts(data_state: dict, was_streams: dict[str, int], manifests: dict[str, str],
                    num_shards: int) -> tuple[dict, dict, dict]:
  """({data shard: {fingerprint: documents}}, {fingerprint: stream slot}, {folder: position})
  of a new stage over the prepared components `manifests` {folder: fingerprint}, from the
  checkpoint's `data_state` {data shard: position} (a prepared one has "consumed") and the
  slots of the stage before (`was_streams`; a stage that did not record them: the order of its
  components, which its "consumed" keeps)."""
  consumed = [(data_state.get(str(s)) or {}).get("consumed") or {} for s in range(num_shards)]
  old = list(consumed[0]) if consumed else []
  was = was_streams or {fp: c for c, fp in enumerate(old)}
  keep = [fp for fp in manifests.values() if fp in old]
  streams = {fp: was[fp] for fp in keep}
  free = (n for n in range(len(was) + len(manifests)) if n not in streams.values())
  for fp in manifests.values():
    if fp not in streams:
      streams[fp] = next(free)
  offsets = {s: {fp: int(consumed[s][fp]) for fp in keep} for s in range(num_shards)} \
      if keep else {}
  sources = {folder: {"fingerprint": fp, "documents": {str(s): offsets[s][fp]
                                                       for s in range(num_shards)}}
             for folder, fp in manifests.items() if fp in keep}
  return offsets, streams, sources
