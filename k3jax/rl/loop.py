"""An RL run (docs/rl.md): the model, the optimizer and the serving engine over the same
arrays, in one process or in several over one mesh (each running the same loop: the same
prompts, the same trajectories; process 0 scores them and hands the rewards to the others).

    each step (iteration.py):  trajectories on the engine and the environments (rollout.py,
        driver.py) -> rewards -> the learner (learner.py: advantages, the reference and, as
        asked, the old-policy and teacher passes, U optimizer steps) -> engine.set_params

    OUT/run.json          options, model config and execution (a resume must match them)
    OUT/checkpoints/<s>/  TrainState (policy, optimizer state, step, RNG key) and the data
                          position; the rollout seeds derive from (seed, step), so a resumed
                          run continues exactly. With a frozen base (LoRA, packed experts)
                          only what is trained and a reference to the base (frozen_base.py):
                          a resume rebuilds the base from --init-from
    OUT/metrics.jsonl     one JSON object per step (iteration.METRICS)
    OUT/tb/               TensorBoard events
    OUT/plots/rl.png      the PLOT panels, written at the end
    OUT/reward_errors.jsonl, OUT/env_errors.jsonl  every sample whose reward or environment
                          failed, with its error
    OUT/model/            the final weights (`k3jax generate OUT`, `--init-from OUT`)

Process 0 alone writes run.json, metrics.jsonl, tb/, plots/ and the error logs; every process
saves and restores its own shards of the checkpoints and of model/.

The reference policy is the initial weights (a copy kept beside the policy), or under LoRA the
base with its adapters off (the same arrays, no copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from convert.fingerprint import weight_bytes
from k3jax.engine import DEFAULT_MAX_MODEL_LEN, Engine
from k3jax.errors import UserError
from k3jax.folders import MODEL_DIR, max_model_len, model_folder
from k3jax.rl import options as options_lib
from k3jax.rl import teacher as teacher_lib
from k3jax.rl.data import PromptStream, load_prompts
from k3jax.rl.driver import Driver, DriverConfig
from k3jax.rl.env import EnvPool, EnvSpec, env_spec
from k3jax.rl.iteration import METRICS, ErrorLog, Iteration
from k3jax.rl.learner import Learner
from k3jax.rl.options import PATHS, RESUME_KEYS, PartialRollout, RLOptions
from k3jax.rl.rewards import Reward
from k3jax.rl.rollout import Rollouts
from k3jax.rl.step import PolicyGradient
from k3jax.run.model import model_config
from k3jax.run.options import adapt_spec, execution
from k3jax.run.placement import initial_params
from k3jax.run.resume import check_base_present, check_resume, checkpoint_sizes, write_run_file
from k3jax.run.start import start
from k3jax.tokenizer import ByteTokenizer, load_tokenizer
from k3jax.train import state as state_lib
from k3jax.train import step as step_lib
from k3jax.train.checkpoint import Checkpointer, save_model
from k3jax.train.metrics import MetricsWriter, read_records
from sharding import distributed
from sharding.mesh import describe
from sharding.placement import check_batch

__all__ = ["METRICS", "RLOptions", "run"]
PLOT = (
    ("reward", (("reward_mean", "mean"), ("reward_std", "std"))),
    ("accuracy (first reward term >= 1)", (("accuracy", "accuracy"),)),
    ("KL(policy || reference), k3", (("kl", "kl"),)),
    ("clip fraction", (("clip_fraction", "clipped"),)),
    ("entropy (nats / token)", (("entropy", "entropy"),)),
    ("completion length (sampled tokens)", (("completion_len", "mean"),)),
    ("turns and tool calls per step", (("turns", "turns / trajectory"),
                                       ("tool_calls", "tool calls"),
                                       ("tool_errors", "tool errors"))),
    ("seconds per step", (("rollout_s", "rollout"), ("reference_s", "reference"),
                          ("train_s", "train"), ("reward_s", "reward"))),
    ("generated tokens / s (rollout)", (("tokens_per_s", "tokens/s"),)),
    ("rollout / trainer mismatch, k3", (("mismatch_kl", "mismatch"),)),
)


def run(opts: RLOptions, *, on_step=None) -> dict[str, Any]:
  """Run the loop; returns a summary. `on_step(step, record)` after each step."""
  with jax.enable_x64(True) if opts.dtype == "float64" else contextlib.nullcontext():
    return _run(opts, on_step)


def _tokenizer(folder, cfg):
  tok = load_tokenizer(folder.tokenizer.kind, folder.tokenizer.folder)
  if isinstance(tok, ByteTokenizer) and cfg.vocab_size != ByteTokenizer.vocab_size:
    raise UserError(f"{folder.weights}: no tokenizer (tiktoken.model) and not a byte-level "
                    "model: RL needs to read and write text")
  if tok.vocab_size > cfg.vocab_size:
    raise UserError(f"the {tok.name} tokenizer has {tok.vocab_size} ids but the model only "
                    f"{cfg.vocab_size} embeddings")
  return tok


def _stop_ids(cfg, tokenizer) -> tuple[int, ...]:
  ids = {int(i) for i in getattr(tokenizer, "stop_ids", ()) or ()}
  if cfg.eos_token_id is not None:
    ids.add(int(cfg.eos_token_id))
  return tuple(sorted(ids))


def _policy(steps: step_lib.Steps, state: dict) -> nnx.Module:
  """The train state's policy as a model over the same arrays (no copy): what the engine runs."""
  return nnx.merge(steps.graphdef, nnx.State(state["params"]), nnx.State(state["router_bias"]))


@dataclasses.dataclass
class _Run:
  """What the steps of an RL run share: set up once (`_set_up`), the state replaced every
  step."""
  opts: RLOptions
  out: str
  mesh: Any
  main: bool                  # process 0: scores, writes run.json, metrics, plots
  folder: Any                 # the --init-from model folder (folders.ModelFolder)
  cfg: Any
  ex: Any
  spec: Any                   # the AdaptSpec (None: full fine-tuning)
  objective: Any              # objectives.ObjectiveConfig
  tokenizer: Any
  prompts: list
  env: EnvSpec
  context: int                # the model's context: longer prompts are skipped
  fitting: list[int]          # the lengths of the prompts that fit it
  max_len: int                # the engine's longest sequence
  seq_len: int                # the train step's positions
  steps: step_lib.Steps
  ckpt: Checkpointer | None = None
  point: state_lib.ResumePoint | None = None
  state: dict | None = None
  ref_params: Any = None      # None under LoRA: the policy's own arrays with adapters off
  stream: PromptStream | None = None
  meta: dict | None = None
  start: int = 0

  @property
  def lora(self) -> bool:
    return self.spec is not None and self.spec.lora


def _run(opts: RLOptions, on_step) -> dict[str, Any]:
  options_lib.check(opts)
  run = _set_up(opts)
  closing = contextlib.ExitStack()
  writer, first, last = None, None, None
  try:
    reward = closing.enter_context(_closing(Reward(opts.reward, opts.max_new_tokens,
                                                   opts.reward_timeout) if opts.reward else None))
    envs = closing.enter_context(_closing(None if run.env.one_turn else EnvPool(
        run.env, opts.prompts_per_step * opts.group_size, opts.env_timeout)))
    run.ckpt = Checkpointer(os.path.join(run.out, "checkpoints"), keep=opts.keep)
    run.point = state_lib.resume_point(run.ckpt, run.steps, run.folder.weights, opts.seed,
                                       run.out)
    _initial_state(run)
    engine = Engine(_policy(run.steps, run.state),
                    options_lib.engine_config(opts, max(run.fitting) if run.env.one_turn else 256,
                                              run.max_len), mesh=run.mesh)
    teachers = _teachers(run)  # a teacher or a row's `teacher` refuses before the run starts
    _announce(run)
    writer = (MetricsWriter(run.out, resume_step=run.point.step, tensorboard=opts.tensorboard)
              if run.main else None)
    step = _iteration(run, engine, reward, envs, teachers)
    first, last = _steps(run, step, writer, on_step)
  finally:
    closing.close()
    sizes = _close_checkpoints(run.ckpt)
    if writer is not None:
      writer.close()
  return _finish(run, first, last, *sizes)


@contextlib.contextmanager
def _closing(thing):
  """`thing`, closed on the way out (None: nothing)."""
  try:
    yield thing
  finally:
    if thing is not None:
      thing.close()


def _set_up(opts: RLOptions) -> _Run:
  """Processes, mesh, model, execution, adapters, the resume checks, prompts, the compiled
  steps' builder: everything that can refuse the run before weights load."""
  started = start(opts, PATHS)
  opts, out, mesh = started.opts, started.out, started.mesh
  check_base_present(out, opts.init_from)
  if not os.path.isdir(opts.init_from):
    raise UserError(f"--init-from {opts.init_from}: no such folder")
  env = env_spec(opts.env, opts.env_args)
  if not env.one_turn and jax.process_count() > 1:
    raise UserError("--env runs in one process (its environments' observations would have to "
                    "reach every process's engine)")
  os.makedirs(out, exist_ok=True)
  folder = model_folder(opts.init_from)
  cfg, ex = model_config(opts.init_from), execution(opts)
  check_resume(out, opts, cfg, ex, RESUME_KEYS, PATHS)
  objective = options_lib.objective_config(opts)
  tokenizer = _tokenizer(folder, cfg)
  prompts = load_prompts(opts.data, tokenizer, rendered=env.one_turn)
  context = opts.max_model_len or max_model_len(folder) or DEFAULT_MAX_MODEL_LEN
  fitting = [len(p.ids) for p in prompts if len(p.ids) < context]
  if not fitting:
    raise UserError(f"every prompt of --data has at least {context} tokens, the context "
                    "(--max-model-len): nothing can be generated")
  max_len = min(context, max(fitting) + opts.max_new_tokens * opts.turns if env.one_turn
                else opts.max_trajectory_tokens or context)
  spec = adapt_spec(opts, cfg)
  if mesh is not None:
    check_batch(opts.prompts_per_step * opts.group_size // opts.grad_accum, mesh)
  steps = step_lib.build(cfg, ex, options_lib.step_config(opts), mesh, spec,
                         PolicyGradient(objective, float(opts.temperature)))
  return _Run(opts, out, mesh, started.main_process, folder, cfg, ex, spec, objective,
              tokenizer, prompts, env, context, fitting, max_len, -(-(max_len - 1) // 8) * 8,
              steps)
def _initial_state(run: _Run) -> None:
  """The TrainState (restored, its frozen base rebuilt; or fresh), the reference policy's
  params (a copy: the train step donates the policy's arrays; none under LoRA), the prompt
  stream at its position; then run.json."""
  opts, point = run.opts, run.point

  def initial():
    return initial_params(run.cfg, run.ex, run.spec, run.folder.weights, opts.seed, run.mesh)

  if point.step is not None:
    params = initial()[0] if point.saved_base or not run.lora else None
    run.state, data_state, run.meta = state_lib.restore(
        run.ckpt, point, run.steps, run.cfg, run.ex, run.spec, opts.seed, (0,), params)
    run.stream = PromptStream(run.prompts, opts.seed, data_state["0"])
    run.start = point.step
    if not run.lora:  # the state's frozen leaves are now params' own arrays: copy them
      run.ref_params = params if not point.saved_base else jax.tree.map(jnp.copy, params)
  else:
    params, bias = initial()
    if not run.lora:  # the train step donates the policy's arrays: the reference is a copy
      run.ref_params = jax.tree.map(jnp.copy, params)
    run.state = state_lib.fresh(run.steps, params, bias, opts.seed)
    run.stream, run.meta = PromptStream(run.prompts, opts.seed), {"rollout_tokens": 0}
  if run.mesh is None:
    run.state = step_lib.place(run.state)  # fresh and resumed states lower to the same program
  if run.main:
    write_run_file(run.out, opts, run.cfg, run.ex)


def _announce(run: _Run) -> None:
  if not run.main:
    return
  opts, objective, spec = run.opts, run.objective, run.spec
  B, G = opts.prompts_per_step, opts.group_size
  print(f"k3jax rl: {opts.init_from} ({run.ex.dtype}{f', LoRA r={spec.rank}' if run.lora else ''}"
        f"{', MXFP4 experts' if spec is not None and spec.base_experts == 'mxfp4' else ''}); "
        f"{len(run.prompts)} prompts ({len(run.prompts) - len(run.fitting)} longer than the "
        f"context {run.context}), {B} x {G} rollouts of <= {opts.max_new_tokens} tokens a step, "
        f"{objective.algorithm} ({objective.loss_agg}, clip {objective.clip_eps}/"
        f"{objective.clip_eps_high}, kl {objective.kl_coef}); "
        + (f"mesh {describe(run.mesh)}, {jax.process_count()} process(es); "
           if run.mesh is not None else "")
        + (f"resuming at step {run.start}" if run.point.step is not None else "from the start"),
        file=sys.stderr, flush=True)


def _teachers(run: _Run) -> tuple[dict, teacher_lib.Assignment | None]:
  """The --teacher models by name, and which one scores each row (every row checked)."""
  opts = run.opts
  teachers = teacher_lib.load(opts.teacher, run.ex.dtype, run.mesh, run.cfg.vocab_size)
  assign = teacher_lib.Assignment(tuple(teachers)) if teachers else None
  if assign is not None:
    for p in run.prompts:
      assign.of(p.row, f"--data {opts.data} row {p.index + 1}")
  return teachers, assign


def _iteration(run: _Run, engine: Engine, reward: Reward | None, envs,
               teachers: tuple[dict, teacher_lib.Assignment | None]) -> Iteration:
  opts = run.opts
  driver = Driver(engine, DriverConfig(max_new_tokens=opts.max_new_tokens,
                                       temperature=opts.temperature,
                                       stop_ids=_stop_ids(run.cfg, run.tokenizer),
                                       max_turns=opts.turns,
                                       max_trajectory_tokens=opts.max_trajectory_tokens),
                  run.tokenizer, envs)
  rollouts = Rollouts(driver, run.stream, prompts_per_step=opts.prompts_per_step,
                      group_size=opts.group_size, seed=opts.seed, context=run.context,
                      budget=opts.rollout_budget,
                      recompute=opts.partial_rollout == PartialRollout.RECOMPUTE,
                      max_staleness=opts.max_staleness, one_turn=run.env.one_turn)
  learner = Learner(opts, run.objective, run.steps, run.ref_params, run.lora, run.seq_len,
                    np.float64 if run.ex.dtype == "float64" else np.float32, run.mesh,
                    *teachers)
  logs = (ErrorLog(run.out, "reward"), ErrorLog(run.out, "env")) if run.main else None
  return Iteration(rollouts, learner, engine, lambda state: _policy(run.steps, state), reward,
                   logs, opts.group_size)


def _steps(run: _Run, step: Iteration, writer, on_step) -> tuple[dict | None, dict | None]:
  """Steps start+1 .. --steps, each logged and, every --save-every, saved; (first, last)
  records. A teacher that stops answering ends the run after a checkpoint of the last step."""
  opts = run.opts
  bar = tqdm(total=opts.steps, initial=run.start, disable=not (opts.progress and run.main),
             unit="step", dynamic_ncols=True, file=sys.stderr)
  # every process loaded: the engine's first programs compile together (its first collective)
  distributed.barrier("k3jax-rl-loaded", opts.startup_timeout)
  first = last = None
  saved = run.start
  for s in range(run.start + 1, opts.steps + 1):
    position = run.stream.state()
    try:
      run.state, record, generated = step(s, run.state)
    except teacher_lib.TeacherUnavailable:
      if s - 1 > saved:
        state_lib.save(run.ckpt, run.point, run.steps, s - 1, run.state,
                       {0: position} if run.main else {}, run.meta)
      raise
    run.meta["rollout_tokens"] = run.meta.get("rollout_tokens", 0) + generated
    if writer is not None:
      writer.write(record)
    if on_step is not None:
      on_step(s, record)
    first, last = first or record, record
    if s % opts.save_every == 0 or s == opts.steps:
      state_lib.save(run.ckpt, run.point, run.steps, s, run.state,
                     {0: run.stream.state()} if run.main else {}, run.meta)
      saved = s
    bar.update(1)
    bar.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record['kl']:.4f}")
  bar.close()
  return first, last


def _close_checkpoints(ckpt: Checkpointer | None) -> tuple[list[int], int | None]:
  """(saved steps, bytes of the last one) once the last async save completed."""
  if ckpt is None:
    return [], None
  ckpt.wait()
  saved = ckpt.all_steps()
  size = ckpt.step_bytes(saved[-1]) if saved else None
  ckpt.close()
  return saved, size


def _finish(run: _Run, first, last, saved_steps, checkpoint_bytes) -> dict[str, Any]:
  """The final weights (OUT/model/), the checkpoint-size line, the plot; the summary."""
  state, base = run.state, run.point.base
  if first is not None:
    save_model(os.path.join(run.out, MODEL_DIR), run.steps.graphdef, state["params"],
               state["router_bias"], run.cfg,
               adapters=None if run.spec is None else run.spec.to_dict())
  base_bytes = (base["bytes"] if base is not None and base["folder"] else
                weight_bytes(run.folder.weights))
  if checkpoint_bytes is not None and run.main:
    print(f"k3jax rl: {checkpoint_sizes(saved_steps[-1], checkpoint_bytes, base_bytes, base)}",
          file=sys.stderr, flush=True)
  plots = []
  if run.opts.plots and run.main:
    from k3jax.train.plots import plot_panels  # noqa: PLC0415 - matplotlib is slow to import; only the end of a run plots
    os.makedirs(os.path.join(run.out, "plots"), exist_ok=True)
    plots = [os.path.join(run.out, "plots", "rl.png")]
    plot_panels(read_records(run.out), PLOT, plots[0])
  return {"out": run.out, "start_step": run.start, "steps": run.opts.steps,
          "first": first, "last": last, "plots": plots,
          "rollout_tokens": run.meta.get("rollout_tokens", 0),
          "checkpoint_bytes": checkpoint_bytes, "base_bytes": base_bytes}
