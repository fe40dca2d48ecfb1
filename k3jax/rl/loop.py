"""An RL run (docs/rl.md): the model, the optimizer and the serving engine over the same
arrays, in one process or in several over one mesh (each running the same loop: the same
prompts, the same completions; process 0 scores them and hands the rewards to the others).

    each step:  B prompts -> G completions each on the engine (the policy's current weights)
                -> rewards -> group advantages -> the reference policy's logprobs
                -> U optimizer steps on the policy-gradient objective -> engine.set_params

    OUT/run.json          options, model config and execution (a resume must match them)
    OUT/checkpoints/<s>/  TrainState (policy, optimizer state, step, RNG key) and the data
                          position; the rollout seeds derive from (seed, step), so a resumed
                          run continues exactly. With a frozen base (LoRA, packed experts)
                          only what is trained and a reference to the base (frozen_base.py):
                          a resume rebuilds the base from --init-from
    OUT/metrics.jsonl     one JSON object per step (METRICS)
    OUT/tb/               TensorBoard events
    OUT/plots/rl.png      the PLOT panels, written at the end
    OUT/reward_errors.jsonl  every sample whose reward failed, with its error
    OUT/model/            the final weights (`k3jax generate OUT`, `--init-from OUT`)

Process 0 alone writes run.json, metrics.jsonl, tb/, plots/ and reward_errors.jsonl; every
process saves and restores its own shards of the checkpoints and of model/.

The reference policy is the initial weights (a copy kept beside the policy), or under LoRA the
base with its adapters off (the same arrays, no copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from convert.fingerprint import weight_bytes
from k3jax.engine import DEFAULT_MAX_MODEL_LEN, Engine, EngineConfig
from k3jax.engine.config import bucket
from k3jax.errors import UserError
from k3jax.folders import MODEL_DIR, absolute, max_model_len, model_folder
from k3jax.rl import objectives as obj_lib
from k3jax.rl.data import PromptStream, load_prompts
from k3jax.rl.rewards import Reward, Sample
from k3jax.rl.rollout import build_batch, draw_seeds, rollout
from k3jax.rl.step import PolicyGradient, logprob_fn
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

# what every metrics.jsonl line holds (all finite): docs/rl.md#metrics
METRICS = ("step", "reward_mean", "reward_std", "accuracy", "kl", "clip_fraction",
           "reward_errors", "entropy", "completion_len", "truncated", "empty_completions",
           "groups_uniform", "groups_dropped", "prompts_too_long", "trained_tokens",
           "mismatch_kl", "mismatch_max", "loss", "grad_norm", "lr", "updates", "rollout_s",
           "reward_s", "reference_s", "train_s", "step_time_s", "tokens_per_s")
PLOT = (
    ("reward", (("reward_mean", "mean"), ("reward_std", "std"))),
    ("accuracy (first reward term >= 1)", (("accuracy", "accuracy"),)),
    ("KL(policy || reference), k3", (("kl", "kl"),)),
    ("clip fraction", (("clip_fraction", "clipped"),)),
    ("entropy (nats / token)", (("entropy", "entropy"),)),
    ("completion length (tokens)", (("completion_len", "mean"),)),
    ("seconds per step", (("rollout_s", "rollout"), ("reference_s", "reference"),
                          ("train_s", "train"), ("reward_s", "reward"))),
    ("generated tokens / s (rollout)", (("tokens_per_s", "tokens/s"),)),
    ("rollout / trainer mismatch, k3", (("mismatch_kl", "mismatch"),)),
)


@dataclasses.dataclass(frozen=True)
class RLOptions:
  init_from: str
  data: str
  reward: tuple[str, ...]
  group_size: int
  steps: int
  out: str
  prompts_per_step: int = 8
  max_new_tokens: int = 64
  temperature: float = 1.0
  updates_per_step: int = 1
  # the objective (objectives.py)
  algorithm: str = "grpo"
  loss_agg: str | None = None        # None: the algorithm's own
  clip_eps: float | None = None      # None: the algorithm's own
  clip_higher: float | None = None   # DAPO's eps_high (None: symmetric)
  kl_coef: float = 0.0
  dynamic_sampling: bool = False     # DAPO: groups whose rewards are all equal do not train
  mask_truncated: bool = False       # DAPO: truncated completions do not train
  reward_timeout: float = 30.0
  # the optimizer (the train step's: Per-Head Muon + AdamW; AdamW on LoRA adapters)
  learning_rate: float = 1e-6
  adam_learning_rate: float | None = None
  warmup_steps: int = 0
  weight_decay: float = 0.0
  clip_norm: float | None = 1.0
  grad_accum: int = 1
  # fine-tuning
  lora_rank: int | None = None
  lora_alpha: float | None = None
  lora_targets: tuple[str, ...] | None = None
  base_experts: str = "float"
  experts_qat: bool = False          # routed experts forward MXFP4-rounded; the engine serves
                                     #   them packed (the model export --merge-lora writes)
  # numerics, devices, engine
  dtype: str = "auto"
  remat: str = "none"
  # how the train step computes, as `k3jax train` takes them (run.options.execution reads them)
  loss_chunk: int | None = None
  attention: str | None = None
  capacity_factor: float | None = None  # refused: every pass that scores rollouts is dropless
  mesh: str | None = None
  # several processes on one mesh (sharding/distributed.py), as `k3jax train` takes them
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  startup_timeout: float = 3600.0
  max_model_len: int | None = None   # the context (default: the folder's, else 8192)
  max_num_seqs: int | None = None    # engine slots (default: every rollout of a step at once)
  # run
  seed: int = 0
  save_every: int = 50
  keep: int = 2
  tensorboard: bool = True
  plots: bool = True
  progress: bool = True
  compile_cache: str | None = None
  # what k3jax.run.options.adapt_spec also reads: RL does not QK-clip
  qk_clip: ClassVar[None] = None


# a resume must keep what fixes the meaning of a checkpoint and of its data position
RESUME_KEYS = ("init_from", "data", "group_size", "prompts_per_step", "seed", "lora_rank",
               "lora_alpha", "lora_targets", "base_experts", "experts_qat", "grad_accum")
PATHS = {"init_from": absolute, "data": absolute}


def objective_config(opts: RLOptions) -> obj_lib.ObjectiveConfig:
  try:
    return obj_lib.ObjectiveConfig(
        algorithm=opts.algorithm, loss_agg=opts.loss_agg, clip_eps=opts.clip_eps,
        clip_eps_high=opts.clip_higher, kl_coef=opts.kl_coef)
  except ValueError as e:
    raise UserError(str(e)) from None


def step_config(opts: RLOptions) -> step_lib.StepConfig:
  """The optimizer of the train step: constant learning rate after `warmup_steps` (RL's
  usual schedule), no Quantile Balancing (the router bias is part of the policy and of the
  reference: it stays as loaded). The cosine's horizon does not depend on --steps (its end
  ratio is 1): a run and its resume with a larger --steps share one compiled step."""
  return step_lib.StepConfig(
      learning_rate=opts.learning_rate, adam_learning_rate=opts.adam_learning_rate,
      warmup_steps=opts.warmup_steps, decay_steps=opts.warmup_steps + 1,
      end_lr_ratio=1.0, weight_decay=opts.weight_decay, clip_norm=opts.clip_norm, qb=False)


# options that count something: each must be at least 1 (None: the default)
COUNTS = ("steps", "prompts_per_step", "max_new_tokens", "updates_per_step", "grad_accum",
          "save_every", "keep", "max_model_len", "max_num_seqs")


def _check(opts: RLOptions) -> None:
  for key in COUNTS:
    value = getattr(opts, key)
    if value is not None and value < 1:
      raise UserError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
  if not opts.reward_timeout > 0:
    raise UserError(f"--reward-timeout must be > 0 seconds, got {opts.reward_timeout}")
  for key in ("learning_rate", "adam_learning_rate"):
    value = getattr(opts, key)
    if value is not None and not value > 0:
      raise UserError(f"--{key.replace('_', '-')} must be > 0, got {value}")
  if opts.warmup_steps < 0:
    raise UserError(f"--warmup-steps must be >= 0, got {opts.warmup_steps}")
  if opts.group_size < 2:
    raise UserError("--group-size must be >= 2: group-relative advantages compare "
                    "completions of the same prompt")
  if not opts.temperature > 0:
    raise UserError("--temperature must be > 0: greedy completions of a prompt are all "
                    "the same")
  if opts.capacity_factor:
    raise UserError(f"capacity factor {opts.capacity_factor}: RL scores every rollout dropless "
                    "(under a capacity a token's experts depend on the other tokens of its "
                    "batch, so the engine's and the trainer's logprobs would differ)")
  rows = opts.prompts_per_step * opts.group_size
  if rows % opts.grad_accum:
    raise UserError(f"--prompts-per-step x --group-size = {rows} rollouts is not a multiple "
                    f"of --grad-accum {opts.grad_accum}")


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


def engine_config(opts: RLOptions, longest_prompt: int, max_len: int) -> EngineConfig:
  """One engine shape for the run: a slot per rollout of a step (or --max-num-seqs), decode
  rows always that many and one attention context (min_decode_rows, min_context): a step's
  rollouts start together and shrink as they finish, so a few programs serve the run. Decode
  blocks of 8 steps once the prompts are read (no host round trip per token)."""
  slots = min(opts.max_num_seqs or 10**9, opts.prompts_per_step * opts.group_size)
  chunk = min(512, max(8, bucket(longest_prompt, 512)))
  page = 16 if max_len <= 256 else 64
  return EngineConfig(max_num_seqs=slots, max_model_len=max_len, page_size=page,
                      prefill_chunk=chunk, prefill_rows=min(slots, max(1, 1024 // chunk)),
                      min_decode_rows=slots, min_context=max_len, max_top_logprobs=1,
                      decode_steps=8, layout="stacked")


def run(opts: RLOptions, *, on_step=None) -> dict[str, Any]:
  """Run the loop; returns a summary. `on_step(step, record)` after each step."""
  with jax.enable_x64(True) if opts.dtype == "float64" else contextlib.nullcontext():
    return _run(opts, on_step)


def _policy(steps: step_lib.Steps, state: dict) -> nnx.Module:
  """The train state's policy as a model over the same arrays (no copy): what the engine runs."""
  return nnx.merge(steps.graphdef, nnx.State(state["params"]), nnx.State(state["router_bias"]))


class _Log:
  """Reward errors: every one to OUT/reward_errors.jsonl, the first few of a step to stderr."""
  SHOWN = 5

  def __init__(self, out: str):
    self.path = os.path.join(out, "reward_errors.jsonl")

  def write(self, step: int, errors: list[tuple[int, int, str]]) -> None:
    if not errors:
      return
    with open(self.path, "a") as f:
      f.writelines(json.dumps({"step": step, "row": row, "sample": sample, "error": error})
                   + "\n" for row, sample, error in errors)
    for row, sample, error in errors[:self.SHOWN]:
      print(f"k3jax rl: step {step}: reward error, data row {row} sample {sample} (reward 0): "
            f"{error}", file=sys.stderr, flush=True)
    if len(errors) > self.SHOWN:
      print(f"k3jax rl: step {step}: {len(errors) - self.SHOWN} more reward errors in "
            f"{self.path}", file=sys.stderr, flush=True)


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
  objective: obj_lib.ObjectiveConfig
  tokenizer: Any
  prompts: list
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
  _check(opts)
  run = _set_up(opts)
  reward = Reward(opts.reward, opts.max_new_tokens, opts.reward_timeout)
  writer, first, last = None, None, None
  try:
    run.ckpt = Checkpointer(os.path.join(run.out, "checkpoints"), keep=opts.keep)
    run.point = state_lib.resume_point(run.ckpt, run.steps, run.folder.weights, opts.seed,
                                       run.out)
    _initial_state(run)
    engine = Engine(_policy(run.steps, run.state),
                    engine_config(opts, max(run.fitting), run.max_len), mesh=run.mesh)
    _announce(run)
    writer = (MetricsWriter(run.out, resume_step=run.point.step, tensorboard=opts.tensorboard)
              if run.main else None)
    first, last = _steps(run, _step_of(run, engine, reward), writer, on_step)
  finally:
    reward.close()
    sizes = _close_checkpoints(run.ckpt)
    if writer is not None:
      writer.close()
  return _finish(run, first, last, *sizes)


def _set_up(opts: RLOptions) -> _Run:
  """Processes, mesh, model, execution, adapters, the resume checks, prompts, the compiled
  steps' builder: everything that can refuse the run before weights load."""
  started = start(opts, PATHS)
  opts, out, mesh = started.opts, started.out, started.mesh
  check_base_present(out, opts.init_from)
  if not os.path.isdir(opts.init_from):
    raise UserError(f"--init-from {opts.init_from}: no such folder")
  os.makedirs(out, exist_ok=True)
  folder = model_folder(opts.init_from)
  cfg, ex = model_config(opts.init_from), execution(opts)
  check_resume(out, opts, cfg, ex, RESUME_KEYS, PATHS)
  objective = objective_config(opts)
  tokenizer = _tokenizer(folder, cfg)
  prompts = load_prompts(opts.data, tokenizer)
  context = opts.max_model_len or max_model_len(folder) or DEFAULT_MAX_MODEL_LEN
  fitting = [len(p.ids) for p in prompts if len(p.ids) < context]
  if not fitting:
    raise UserError(f"every prompt of --data has at least {context} tokens, the context "
                    "(--max-model-len): nothing can be generated")
  max_len = min(context, max(fitting) + opts.max_new_tokens)
  spec = adapt_spec(opts, cfg)
  if mesh is not None:
    check_batch(opts.prompts_per_step * opts.group_size // opts.grad_accum, mesh)
  steps = step_lib.build(cfg, ex, step_config(opts), mesh, spec,
                         PolicyGradient(objective, float(opts.temperature)))
  return _Run(opts, out, mesh, started.main_process, folder, cfg, ex, spec, objective,
              tokenizer, prompts, context, fitting, max_len, -(-(max_len - 1) // 8) * 8, steps)


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


def _step_of(run: _Run, engine: Engine, reward: Reward) -> _Step:
  opts = run.opts
  return _Step(opts, run.objective, run.steps, engine,
               logprob_fn(run.steps, float(opts.temperature), adapters_off=run.lora),
               run.ref_params, run.stream, reward, _Log(run.out) if run.main else None,
               _stop_ids(run.cfg, run.tokenizer), run.tokenizer.decode, run.context,
               run.seq_len, np.float64 if run.ex.dtype == "float64" else np.float32, run.mesh)


def _steps(run: _Run, step: _Step, writer, on_step) -> tuple[dict | None, dict | None]:
  """Steps start+1 .. --steps, each logged and, every --save-every, saved; (first, last)
  records."""
  opts = run.opts
  bar = tqdm(total=opts.steps, initial=run.start, disable=not (opts.progress and run.main),
             unit="step", dynamic_ncols=True, file=sys.stderr)
  # every process loaded: the engine's first programs compile together (its first collective)
  distributed.barrier("k3jax-rl-loaded", opts.startup_timeout)
  first = last = None
  for s in range(run.start + 1, opts.steps + 1):
    run.state, record, generated = step(s, run.state)
    run.meta["rollout_tokens"] = run.meta.get("rollout_tokens", 0) + generated
    if writer is not None:
      writer.write(record)
    if on_step is not None:
      on_step(s, record)
    first, last = first or record, record
    if s % opts.save_every == 0 or s == opts.steps:
      state_lib.save(run.ckpt, run.point, run.steps, s, run.state,
                     {0: run.stream.state()} if run.main else {}, run.meta)
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


@dataclasses.dataclass
class _Step:
  """One RL step of a run (its constants held here); `__call__(s, state)` -> (new state, its
  metrics record, generated tokens)."""
  opts: RLOptions
  objective: obj_lib.ObjectiveConfig
  steps: step_lib.Steps
  engine: Engine
  logprobs_of: Any
  ref_params: Any          # None under LoRA: the policy's own arrays with adapters off
  stream: PromptStream
  reward: Reward
  errors_log: _Log | None  # None on processes other than 0: they do not score
  stop_ids: tuple[int, ...]
  decode: Any
  context: int
  seq_len: int
  wide: Any                # float dtype of the batch's logprobs and weights
  mesh: Any
  met: bool = False        # several processes: compiled and met before the first collective

  def __call__(self, s: int, state: dict) -> tuple[dict, dict, int]:
    opts, objective, steps, engine = self.opts, self.objective, self.steps, self.engine
    B, G, A = opts.prompts_per_step, opts.group_size, opts.grad_accum
    n_rows, seq_len = B * G, self.seq_len
    t0 = time.perf_counter()
    batch_prompts = self.stream.next(B)
    seeds = draw_seeds(opts.seed, s, B, G)
    slots = [i for i, p in enumerate(batch_prompts) if len(p.ids) < self.context]
    groups = rollout(engine, [batch_prompts[i] for i in slots], G,
                     max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                     stop_ids=self.stop_ids, seeds=[seeds[i] for i in slots],
                     decode=self.decode)
    t_rollout = time.perf_counter()

    rewards, passed, n_errors = self._score(s, groups)
    adv = obj_lib.group_advantages(rewards, objective.normalize_std, objective.std_eps)
    uniform = rewards.max(axis=1) == rewards.min(axis=1) if groups else np.zeros(0, bool)
    dropped = uniform if opts.dynamic_sampling else np.zeros_like(uniform)
    rows = [(c, adv[p, g], not dropped[p] and not (opts.mask_truncated and c.truncated))
            for p, group in enumerate(groups) for g, c in enumerate(group)]
    batch = build_batch(rows, n_rows, seq_len, self.wide)
    batch.arrays["weights"] = obj_lib.token_weights(
        batch.arrays["loss_mask"], objective.loss_agg, opts.max_new_tokens).astype(self.wide)
    t_reward = time.perf_counter()

    rollout_tokens = int(batch.rollout_mask.sum())
    trained_tokens = int(batch.arrays["loss_mask"].sum())
    kl, train = 0.0, []
    t_ref = t_reward
    if rollout_tokens:
      dev = {k: v.reshape(A, n_rows // A, seq_len) for k, v in batch.arrays.items()}
      if self.mesh is not None:  # every process holds the whole batch: it places its shards
        dev = jax.device_put(dev, steps.batch_sharding)
      ref_params = state["params"] if self.ref_params is None else self.ref_params
      if not self.met and jax.process_count() > 1:
        self._compile_then_meet(state, ref_params, dev)
      ref = self.logprobs_of(ref_params, state["router_bias"], dev)
      ref_np = distributed.fetch(ref).astype(np.float64).reshape(n_rows, seq_len)
      old = batch.arrays["old_logp"].astype(np.float64)
      m = batch.rollout_mask
      kl = float(np.mean(obj_lib.k3(ref_np[m], old[m], xp=np)))
      t_ref = time.perf_counter()
      if trained_tokens:
        dev["ref_logp"] = ref
        for _ in range(opts.updates_per_step):
          state, metrics = steps.train(state, dev, step_lib.NO_QK_CLIP)
          train.append(jax.device_get(metrics))
        engine.set_params(nnx.state(_policy(steps, state)))
    t_train = time.perf_counter()

    completions = [c for group in groups for c in group]
    lengths = np.array([len(c.tokens) for c in completions]) if completions else np.zeros(1)
    generated = int(sum(len(c.tokens) for c in completions))
    record = {
        "step": s,
        "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
        "reward_std": float(rewards.std()) if rewards.size else 0.0,
        "accuracy": float(passed.mean()) if passed.size else 0.0,
        "kl": kl,
        "reward_errors": n_errors,
        "completion_len": float(lengths.mean()),
        "truncated": (float(np.mean([c.truncated for c in completions])) if completions
                      else 0.0),
        "empty_completions": sum(1 for c in completions if not c.text.strip()),
        "groups_uniform": int(uniform.sum()),
        "groups_dropped": int(dropped.sum()),
        "prompts_too_long": B - len(slots),
        "trained_tokens": trained_tokens,
        "updates": len(train),
        **_train_metrics(train, objective),
        "rollout_s": t_rollout - t0,
        "reward_s": t_reward - t_rollout,
        "reference_s": t_ref - t_reward,
        "train_s": t_train - t_ref,
        "step_time_s": t_train - t0,
        "tokens_per_s": generated / max(t_rollout - t0, 1e-9),
    }
    for key in METRICS:  # finite by construction; a failure here is a bug, not bad input
      assert key in record and math.isfinite(record[key]), (key, record.get(key))
    return state, record, generated

  def _score(self, s: int, groups) -> tuple[np.ndarray, np.ndarray, int]:
    """([prompt, sample] rewards, [prompt, sample] first term passed, errors) of a step.
    Process 0 scores (a user function may time out on one host and not on another) and logs
    the errors; the others take its values."""
    G = self.opts.group_size
    rewards = np.zeros((len(groups), G))
    passed = np.zeros((len(groups), G), np.int32)
    errors = []
    if self.errors_log is not None:
      for p, group in enumerate(groups):
        for g, c in enumerate(group):
          score = self.reward.score(Sample(c.prompt.text, c.text, c.prompt.row, len(c.tokens)))
          rewards[p, g], passed[p, g] = score.value, score.passed
          if score.error is not None:
            errors.append((c.prompt.index, g, score.error))
      self.errors_log.write(s, errors)
    rewards, passed, n_errors = distributed.from_main(
        (rewards, passed, np.asarray(len(errors), np.int32)))
    return rewards, passed.astype(bool), int(n_errors)

  def _compile_then_meet(self, state: dict, ref_params, dev: dict) -> None:
    """Compile the reference logprobs and the train step (their first calls reuse the
    executables), then wait for every process: on CPU gloo gives a peer 30 s to join a first
    collective (docs/sharding.md#multi-host). The engine's programs compile at their first
    call, in step with the other processes (the same program on each)."""
    steps = self.steps
    self.logprobs_of.lower(ref_params, state["router_bias"], dev).compile()
    batch = {**dev, "ref_logp": dev["old_logp"]}  # the reference's shape, dtype and sharding
    steps.train.lower(state, batch, step_lib.NO_QK_CLIP).compile()
    distributed.barrier("k3jax-rl-compiled", self.opts.startup_timeout)
    self.met = True


def _train_metrics(train: list[dict], objective) -> dict:
  """Means over the step's updates (the first update alone for the mismatch: its policy is
  the rollout's); zeros when nothing trained."""
  if not train:
    return {"clip_fraction": 0.0, "entropy": 0.0, "mismatch_kl": 0.0, "mismatch_max": 0.0,
            "loss": 0.0, "grad_norm": 0.0, "lr": 0.0}
  per = "sequences" if objective.algorithm == obj_lib.Algorithm.GSPO else "tokens"

  def ratio(m, key, den):
    return float(m[key]) / max(float(m[den]), 1.0)

  first = train[0]
  return {
      "clip_fraction": float(np.mean([ratio(m, "clipped", per) for m in train])),
      "entropy": ratio(first, "entropy", "tokens"),
      "mismatch_kl": ratio(first, "mismatch_k3", "tokens"),
      "mismatch_max": float(first["max_abs_log_ratio"]),
      "loss": float(np.mean([float(m["loss"]) for m in train])),
      "grad_norm": float(np.mean([float(m["grad_norm"]) for m in train])),
      "lr": float(train[-1]["lr"]),
  }
