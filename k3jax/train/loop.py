"""A training run: set-up, resume, the step loop, eval, logging, checkpoints, plots.

    OUT/run.json          options, model config and execution of the run (a resume must
                          match them)
    OUT/checkpoints/<s>/  Orbax checkpoints (checkpoint.py), the last `keep` of them; with a
                          frozen base (LoRA, packed experts) only what is trained and a
                          reference to the base (frozen_base.py)
    OUT/metrics.jsonl     one JSON object per logged step (metrics.py)
    OUT/tb/               TensorBoard events
    OUT/plots/*.png       loss and expert load (plots.py), written at the end
    OUT/model/            the final weights as a k3jax model checkpoint (k3jax_config.json +
                          Orbax): `k3jax export OUT/model HF_DIR`, or `--init-from OUT/model`

Running again with the same OUT resumes from the last complete checkpoint (params, optimizer
state, router biases, step, RNG key and data position), so `--steps` can be raised to train
on. The cosine schedule spans `decay_steps` (default: `steps`): give it explicitly to stop and
resume on the same schedule.

The run is set up by k3jax/run (processes, mesh, model config, execution, adapters, the resume
checks, the initial parameters in their shardings) and state.py (the TrainState: fresh or
restored); then one `_Run` holds what the steps share and `_train` runs them: each a batch
(`_batch`), the step (`_step`), eval and the metrics line (`_log`), a checkpoint (`_save`).

On a mesh (`mesh="data=2,expert=2,tensor=2"`, docs/sharding.md) the state is created, restored
and updated in its shardings (step.py), and with several processes (`coordinator`,
`num_processes`, `process_id`, or a Cloud TPU environment) each process reads only the data
shards whose rows its devices hold; every process saves and restores its own shards of a
checkpoint, and process 0 alone writes run.json, metrics.jsonl, TensorBoard, the plots and
`model/`'s config file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from convert.fingerprint import weight_bytes
from k3jax.config import ModelConfig
from k3jax.errors import UserError
from k3jax.execution import Execution
from k3jax.folders import MODEL_DIR, RUN_FILE, model_folder, tokenizer_source
from k3jax.model import context_parallel
from k3jax.model.lora import AdaptSpec
from k3jax.run.model import model_config
from k3jax.run.options import adapt_spec, execution
from k3jax.run.placement import initial_params
from k3jax.run.preemption import Preemption, SaveClock
from k3jax.run.resume import (
  check_base_present,
  check_resume,
  checkpoint_sizes,
  read_run_file,
  write_run_file,
)
from k3jax.run.start import start
from k3jax.run.watchdog import Deadlines, Watchdog
from k3jax.tokenizer import load_tokenizer
from k3jax.train import data as data_lib
from k3jax.train import flops as flops_lib
from k3jax.train import inputs as inputs_lib
from k3jax.train import stages as stages_lib
from k3jax.train import state as state_lib
from k3jax.train import step as step_lib
from k3jax.train.checkpoint import Checkpointer, save_model
from k3jax.train.goodput import Goodput
from k3jax.train.metrics import MetricsWriter, read_records
from k3jax.train.options import PATHS, RESUME_KEYS, RunOptions, objective, step_config
from k3jax.train.stages import STAGE_KEYS
from k3jax.train.stepper import Stepper, stop_reason, who
from sharding import distributed
from sharding.mesh import describe
from sharding.placement import check_batch

__all__ = ["RunOptions", "adapt_spec", "execution", "run", "step_config"]


def run(opts: RunOptions, *, on_step=None) -> dict[str, Any]:
  """Train; returns a summary. `on_step(step, record)` is called after each logged step."""
  with jax.enable_x64(True) if opts.dtype == "float64" else contextlib.nullcontext():
    return _run(opts, on_step)


@dataclasses.dataclass
class _Run:
  """What the steps of a run share: set up once (`_set_up`), the state replaced every step."""
  opts: RunOptions
  out: str
  mesh: jax.sharding.Mesh | None
  main: bool                  # process 0: writes run.json, metrics, TensorBoard, plots
  cfg: ModelConfig
  ex: Execution
  spec: AdaptSpec | None
  steps: step_lib.Steps
  pipe: data_lib.PipelineConfig
  rows: tuple[int, int]       # the rows of each micro-batch this process supplies
  positions: tuple[int, int]  # ... and the positions of those rows (all but with `context`)
  read_shards: list[int]      # the data shards it reads ...
  write_shards: list[int]     # ... and those whose position it checkpoints
  ckpt: Checkpointer
  point: state_lib.ResumePoint
  chosen: inputs_lib.DataChoice   # the data named, checked before OUT was written
  data: inputs_lib.TrainingData | None = None
  data_description: str = ""      # the data and tokenizer, for the start-up line
  eval_batches: list | None = None
  state: dict | None = None
  data_state: dict | None = None  # the data position restored (None: from the start)
  meta: dict | None = None        # tokens seen, train seconds (checkpointed)
  start: int = 0                  # the step the run starts after
  watchdog: Watchdog | None = None
  deadlines: Deadlines | None = None
  preemption: Preemption | None = None
  clock: SaveClock | None = None
  goodput: Goodput | None = None
  stages: list = dataclasses.field(default_factory=list)  # the run's stages (stages.py)
  data_offsets: dict = dataclasses.field(default_factory=dict)  # shard -> pieces skipped
  data_streams: dict | None = None  # prepared data: a stage's {fingerprint: stream slot}

  @property
  def rows_per_micro(self) -> int:
    return self.opts.batch_size // self.opts.grad_accum

  def to_device(self, batch: dict, rows: tuple[int, int] | None = None):
    """A batch of this process's rows as the step's global arrays (as it is: no mesh); of
    those rows only the positions this process's devices hold are kept (a `context` axis
    splits them)."""
    if self.mesh is None:
      return batch
    p0, p1 = self.positions
    mine = {k: v[:, :, p0:p1] for k, v in batch.items()}
    return distributed.global_batch(mine, self.steps.batch_sharding, rows or self.rows,
                                    self.rows_per_micro, positions=self.positions,
                                    num_positions=self.opts.seq_len)


@dataclasses.dataclass
class _Meter:
  """The rates of a step: tokens, model FLOPs and the peak they are measured against."""
  flop_count: Any
  tokens_per_step: int
  peak: float                     # FLOP/s of every device together
  peak_source: str                # flops.PeakSource: chip | flag | measured

  def mfu(self, seconds: float) -> float:
    return self.flop_count.train_per_token * self.tokens_per_step / seconds / self.peak


@dataclasses.dataclass
class _Tally:
  """What the step loop has seen, for the summary."""
  first_loss: float | None = None
  last_loss: float | None = None
  eval_loss: float | None = None
  compile_s: float | None = None  # the first step of a process: tracing and compilation too
  step_times: list[float] = dataclasses.field(default_factory=list)
  t_prev: float = dataclasses.field(default_factory=time.perf_counter)
  saved_steps: list[int] = dataclasses.field(default_factory=list)
  checkpoint_bytes: int | None = None
  preempted: int | None = None    # the step the run stopped and saved at when told to stop


class _NoWriter:
  """Processes other than 0 write no metrics."""

  def write(self, record) -> None:
    pass

  def close(self) -> None:
    pass


def _run(opts: RunOptions, on_step) -> dict[str, Any]:
  _check(opts)
  preemption = Preemption()  # before the processes join (preemption.py)
  try:
    run = _set_up(opts)
    run.preemption, run.clock = preemption, SaveClock(opts.save_every_minutes)
    run.watchdog = Watchdog("train")
    run.deadlines = Deadlines(opts.startup_timeout, opts.step_timeout)
    try:
      return _start_and_train(run, on_step)
    finally:
      run.watchdog.close()
      run.ckpt.close()  # (closed already unless the run failed before its steps)
  finally:
    preemption.close()


def _check(opts: RunOptions) -> None:
  if opts.steps < 1:
    raise UserError("--steps must be >= 1")
  if opts.profile_steps is not None:
    a, b = opts.profile_steps
    if not 1 <= a <= b <= opts.steps:
      raise UserError(f"--profile-steps {a}:{b} is outside the run's steps 1-{opts.steps} "
                      "(or its end comes before its start)")
  if opts.save_every_minutes is not None and not opts.save_every_minutes > 0:
    raise UserError(f"--save-every-minutes must be > 0, got {opts.save_every_minutes}")


def _start_and_train(run: _Run, on_step) -> dict[str, Any]:
  _load_data(run)
  with run.watchdog.phase("start-up: restoring or creating the initial state",
                          run.deadlines.startup_s):
    _initial_state(run)
  meter = _meter(run)
  _announce(run, meter)
  if run.preemption.reached():  # told to stop before the first step: nothing new to save
    return _stopped_at_start_up(run, meter)
  tally = _train(run, meter, on_step)
  return _finish(run, meter, tally)


def _set_up(opts: RunOptions) -> _Run:
  """Processes, mesh, model, execution, adapters, the resume checks, the compiled steps'
  builder and the checkpoints: everything that can refuse the run before data or weights
  load."""
  started = start(opts, PATHS)
  opts, out, mesh = started.opts, started.out, started.mesh
  # the data checked before anything is written (a bad manifest or mixture writes no --out)
  chosen = inputs_lib.choose_data(opts.data, opts.data_mix, opts.data_format,
                                  os.path.join(out, RUN_FILE), opts.new_stage)
  os.makedirs(out, exist_ok=True)
  check_base_present(out, opts.init_from)
  cfg, ex = model_config(opts.init_from, opts.config), execution(opts)
  saved = read_run_file(out)
  check_resume(out, opts, cfg, ex, tuple(k for k in RESUME_KEYS if k not in STAGE_KEYS), PATHS)
  stages_lib.check_stage(out, saved, opts, PATHS, chosen.changed)
  sc = step_config(opts)
  if mesh is not None:
    check_batch(opts.batch_size // opts.grad_accum, mesh)
    context_parallel.check(mesh, opts.seq_len, ex.kda_backend)
  spec = adapt_spec(opts, cfg)
  # refuses a mesh the model cannot be split on
  steps = step_lib.build(cfg, ex, sc, mesh, spec, objective(opts))
  pipe = data_lib.PipelineConfig(opts.seq_len, opts.batch_size, opts.grad_accum, opts.seed,
                                 num_shards=opts.data_shards)
  rows, read_shards, write_shards = _process_rows_and_shards(steps, pipe, opts)
  positions = (0, opts.seq_len)
  if mesh is not None:
    shape = (opts.grad_accum, opts.batch_size // opts.grad_accum, opts.seq_len)
    positions = distributed.rows_by_process(steps.batch_sharding, shape, axis=2)[
        jax.process_index()]
  ckpt = Checkpointer(os.path.join(out, "checkpoints"), keep=opts.keep)
  point = state_lib.resume_point(ckpt, steps, _init_weights(opts), opts.seed, out)
  return _Run(opts, out, mesh, started.main_process, cfg, ex, spec, steps, pipe, rows,
              positions, read_shards, write_shards, ckpt, point, chosen,
              stages=stages_lib.stages(saved, opts))


def _init_weights(opts: RunOptions) -> str | None:
  """The weights folder of --init-from (a run folder's model/), or None."""
  return model_folder(opts.init_from).weights if opts.init_from else None


def _process_rows_and_shards(steps: step_lib.Steps, pipe: data_lib.PipelineConfig,
                             opts: RunOptions):
  """(rows of each micro-batch this process supplies, the data shards it reads, those whose
  state it writes into checkpoints: each shard by the lowest process reading it)."""
  rows_per_micro = opts.batch_size // opts.grad_accum
  if steps.mesh is None:
    by_process = {0: (0, rows_per_micro)}
  else:
    shape = (opts.grad_accum, rows_per_micro, opts.seq_len)
    by_process = distributed.rows_by_process(steps.batch_sharding, shape)
  me = jax.process_index()
  writers = data_lib.shard_writers(pipe, by_process)
  mine = data_lib.shards_for_rows(pipe, by_process[me])
  return by_process[me], mine, [s for s in mine if writers[s] == me]


def _load_data(run: _Run) -> None:
  """The tokenizer, the training data and the held-out batches (every process holds all of
  those: they are small and fixed)."""
  opts = run.opts
  source = tokenizer_source(opts.tokenizer, opts.init_from)
  tokenizer = load_tokenizer(source.kind, source.folder)
  if tokenizer.vocab_size > run.cfg.vocab_size:
    raise UserError(f"the {tokenizer.name} tokenizer has {tokenizer.vocab_size} ids but the "
                    f"model only {run.cfg.vocab_size} embeddings")
  run.data = inputs_lib.load_training_data(
      opts.data, opts.data_format, tokenizer, run.pipe, opts.eval_batches,
      skip_bad_rows=opts.skip_bad_rows, out=run.out if run.main else None, mix=run.chosen.mix,
      data_version=run.chosen.version, workers=opts.data_workers)
  run.data_description = f"{run.data.description} ({tokenizer.name})"
  run.eval_batches = [run.to_device(b, (0, run.rows_per_micro))
                      for b in run.data.eval_batches]


def _initial_state(run: _Run) -> None:
  """The TrainState: restored from the last checkpoint (its frozen base rebuilt), or fresh
  over the initial parameters; then run.json."""
  opts, point = run.opts, run.point
  if opts.new_stage and point.step is None:
    raise UserError(f"--new-stage: {run.out} holds no checkpoint to continue from")
  if point.step is not None:
    base = None
    if point.saved_base:  # the frozen leaves, rebuilt as the run first built them
      base = _initial_params(run, point.base["folder"])[0]
    shards = range(run.pipe.num_shards) if opts.new_stage else run.read_shards
    run.state, data_state, run.meta = state_lib.restore(
        run.ckpt, point, run.steps, run.cfg, run.ex, run.spec, opts.seed, shards, base)
    run.start = int(run.state["step"])
    _data_position(run, data_state)
  else:
    params, bias = _initial_params(run, _init_weights(opts))
    run.state = state_lib.fresh(run.steps, params, bias, opts.seed)
    run.meta = {"tokens_seen": 0, "train_seconds": 0.0}
  run.goodput = Goodput(run.out, run.meta)
  if opts.profile_steps is not None and opts.profile_steps[0] <= run.start:
    raise UserError(f"--profile-steps {opts.profile_steps[0]}:{opts.profile_steps[1]} is "
                    f"outside the run: it resumes after step {run.start}")
  if run.mesh is None:
    # Orbax restores committed arrays; placing a fresh state the same way makes a fresh run
    # and a resumed one lower to the same program (one persistent-cache entry, not two)
    run.state = step_lib.place(run.state)
  if run.main:
    write_run_file(run.out, opts, run.cfg, run.ex, data=run.chosen.identity,
                   stages=run.stages)


def _data_position(run: _Run, data_state: dict) -> None:
  """Where the data pipelines continue: the checkpoint's positions in the stage they were
  saved in; at a new stage, its sources' positions carried over (stages.py), and a resume at
  the very start of a stage starts its pipelines at the stage's offsets."""
  stage = run.stages[-1]
  if run.opts.new_stage:
    streams = None
    if run.data.open_stage is not None:  # prepared data
      offsets, streams, positions = stages_lib.prepared_starts(
          data_state, stage.get("streams"), run.chosen.identity["manifests"],
          run.pipe.num_shards)
    else:
      offsets, positions = _continued(run, data_state, stage)
    run.stages = stages_lib.new_stage(run.stages, run.start, run.opts, positions, offsets,
                                      streams)
    stage = run.stages[-1]
    _say(run, f"k3jax train: stage {stage['stage']} starts after step {run.start}: "
          + ", ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in stage["options"].items()
                      if stage["options"][k] != run.stages[-2]["options"].get(k))
          + (f"; {', '.join(positions)} continue{'s' if len(positions) == 1 else ''} at "
             "the same position" if positions else "; the data starts from its beginning"))
  fresh = run.opts.new_stage or (stage["stage"] > 0 and run.start == stage["start_step"])
  run.data_state = None if fresh else data_state
  run.data_offsets = {int(k): v for k, v in stage.get("data_offsets", {}).items()}
  run.data_streams = stage.get("streams")


def _say(run: _Run, line: str) -> None:
  if run.main:
    print(line, flush=True)


def _continued(run: _Run, data_state: dict, stage: dict) -> tuple[dict, dict]:
  """({data shard: pieces to skip}, {source: its position in epochs per shard}) of the new
  stage: a source it shares with `stage` continues where that stage's pipelines were."""
  was = stage["options"]
  if (was.get("data") or stages_lib.STDLIB) != stages_lib.source_of(run.opts) or \
      was.get("data_format", "text") != run.opts.data_format or was.get("data_mix"):
    return {}, {}
  old = data_lib.PipelineConfig(was["seq_len"], was["batch_size"], was.get("grad_accum", 1),
                                run.opts.seed, num_shards=run.pipe.num_shards)
  tokens, skipped = run.data.train_tokens, stage.get("data_offsets", {})
  offsets, epochs = {}, {}
  for shard in range(run.pipe.num_shards):
    done = skipped.get(str(shard), 0) + data_lib.consumed_pieces(data_state[str(shard)])
    epochs[shard] = done / len(data_lib.shard_pieces(tokens, old, shard))
    offsets[shard] = round(epochs[shard] * len(data_lib.shard_pieces(tokens, run.pipe, shard)))
  return offsets, {stages_lib.source_of(run.opts): {str(k): v for k, v in epochs.items()}}


def _initial_params(run: _Run, weights: str | None):
  return initial_params(run.cfg, run.ex, run.spec, weights, run.opts.seed, run.mesh)


def _meter(run: _Run) -> _Meter:
  opts = run.opts
  devices = 1 if run.mesh is None else run.mesh.size
  peak, source = flops_lib.device_peak(opts.peak_tflops, run.ex.jnp_dtype)
  return _Meter(flops_lib.count(run.cfg, opts.seq_len), opts.batch_size * opts.seq_len,
                devices * peak, source.value)


def _announce(run: _Run, meter: _Meter) -> None:
  """The start-up line (process 0), and each process's rows and data shards."""
  opts, mesh = run.opts, run.mesh
  if run.main:
    n_params = step_lib.count_params(run.state["params"])
    print(f"k3jax train: {n_params / 1e6:.2f}M params "
          f"({meter.flop_count.active_matmul_params / 1e6:.2f}M active matmul), "
          f"{run.ex.dtype} compute / {run.ex.param_dtype} master; {run.data_description}; "
          f"batch {opts.batch_size} x {opts.seq_len}"
          f"{f' ({opts.grad_accum} micro-batches)' if opts.grad_accum > 1 else ''}; "
          + (f"mesh {describe(mesh)}, {jax.process_count()} process(es), "
             f"{opts.data_shards} data shard(s); " if mesh is not None else "")
          + (f"resuming from step {run.start}" if run.point.step is not None else
             "from scratch" if not opts.init_from else f"from {opts.init_from}"), flush=True)
  if jax.process_count() > 1:
    print(f"k3jax train: process {jax.process_index()}/{jax.process_count()} supplies rows "
          f"[{run.rows[0]}, {run.rows[1]}) of each micro-batch from data shard(s) "
          f"{run.read_shards}", flush=True)


def _train(run: _Run, meter: _Meter, on_step) -> _Tally:
  """Steps start+1 .. --steps (stepper.py); the checkpoints and the metrics file are closed
  however the loop ends."""
  opts, tally = run.opts, _Tally()
  writer = (MetricsWriter(run.out, resume_step=run.point.step, tensorboard=opts.tensorboard)
            if run.main else _NoWriter())
  iterator = run.data.iterator(run.pipe, run.rows, run.data_state, run.data_offsets,
                               run.data_streams)
  bar = tqdm(total=opts.steps, initial=run.start, disable=not (opts.progress and run.main),
             unit="step", dynamic_ncols=True)
  qk_threshold = step_lib.NO_QK_CLIP if opts.qk_clip is None else np.float32(opts.qk_clip)
  stepper = Stepper(run, meter, tally, writer, on_step, iterator, bar, qk_threshold)
  try:
    stepper.run_steps()
  finally:
    stepper.close()
    bar.close()
    iterator.close()
    _close_checkpoints(run, tally)
    writer.close()
  return tally


def _stopped_at_start_up(run: _Run, meter: _Meter) -> dict[str, Any]:
  """Told to stop before the first step: nothing ran, the last checkpoint stands."""
  run.ckpt.close()
  last = "the run starts from scratch" if run.point.step is None else \
      f"it resumes from checkpoint {run.point.step}"
  print(f"k3jax train: {who()}{stop_reason()} during start-up, before step {run.start + 1}: "
        f"nothing new to save; run the same command again ({last})", flush=True)
  return _summary(run, meter, _Tally(preempted=run.start), [])


def _close_checkpoints(run: _Run, tally: _Tally) -> None:
  run.ckpt.wait()  # the last async save completes before the run reports
  tally.saved_steps = run.ckpt.all_steps()
  if tally.saved_steps:
    tally.checkpoint_bytes = run.ckpt.step_bytes(tally.saved_steps[-1])
  run.ckpt.close()


def _finish(run: _Run, meter: _Meter, tally: _Tally) -> dict[str, Any]:
  """The final weights (OUT/model/), the checkpoint-size line, the plots; the summary."""
  opts, state, base = run.opts, run.state, run.point.base
  if tally.first_loss is not None and tally.preempted is None:  # the final weights
    save_model(os.path.join(run.out, MODEL_DIR), run.steps.graphdef, state["params"],
               state["router_bias"], run.cfg,
               adapters=None if run.spec is None else run.spec.to_dict())
  base_bytes = (base["bytes"] if base is not None and base["folder"] else
                weight_bytes(_init_weights(opts)) if opts.init_from else None)
  if run.main and tally.checkpoint_bytes is not None and tally.preempted is None:
    sizes = checkpoint_sizes(tally.saved_steps[-1], tally.checkpoint_bytes, base_bytes, base)
    print(f"k3jax train: {sizes}", flush=True)
  plots = []
  if opts.plots and run.main and tally.preempted is None:
    from k3jax.train.plots import write_plots  # noqa: PLC0415 - matplotlib is slow to import; only the end of a run plots
    plots = write_plots(read_records(run.out), run.out)
  summary = _summary(run, meter, tally, plots)
  summary["base_bytes"] = base_bytes
  return summary


def _summary(run: _Run, meter: _Meter, tally: _Tally, plots: list) -> dict[str, Any]:
  opts, state = run.opts, run.state
  median = float(np.median(tally.step_times)) if tally.step_times else None
  return {
      "out": run.out, "start_step": run.start, "steps": opts.steps,
      "first_loss": tally.first_loss, "last_loss": tally.last_loss,
      "eval_loss": tally.eval_loss, "compile_and_first_step_s": tally.compile_s,
      "median_step_s": median,
      "tokens_per_s": meter.tokens_per_step / median if median else None,
      "mfu": meter.mfu(median) if median else None,
      "peak_flops": meter.peak, "peak_source": meter.peak_source, "plots": plots,
      "checkpoints": tally.saved_steps,
      "data": run.data.summary,
      "trainable_params": step_lib.count_params(
          step_lib.partition(state["params"], run.steps.trainable)[0]),
      "total_params": step_lib.count_params(state["params"]),
      "checkpoint_bytes": tally.checkpoint_bytes, "base_bytes": None,
      "preempted": tally.preempted, **run.goodput.summary(),
  }
