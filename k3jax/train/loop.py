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

On a mesh (`mesh="data=2,expert=2,tensor=2"`, docs/sharding.md) the state is created, restored and
updated in its shardings (step.py), and with several processes (`coordinator`,
`num_processes`, `process_id`, or a Cloud TPU environment) each process reads only the data
shards whose rows its devices hold; every process saves and restores its own shards of a
checkpoint, and process 0 alone writes run.json, metrics.jsonl, TensorBoard, the plots and
`model/`'s config file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

import configs
from convert import load as convert_load
from convert.fingerprint import weight_bytes
from convert.hf_load import load_model
from k3jax.config import ModelConfig
from k3jax.errors import ConfigError, UserError
from k3jax.execution import Execution, recorded, resolve_dtype
from k3jax.folders import (
  MODEL_DIR,
  RUN_FILE,
  absolute,
  absolute_tokenizer,
  model_folder,
  tokenizer_source,
)
from k3jax.model import lora
from k3jax.model.transformer import K3Model
from k3jax.tokenizer import load_tokenizer
from k3jax.train import data as data_lib
from k3jax.train import flops as flops_lib
from k3jax.train import frozen_base
from k3jax.train import inputs as inputs_lib
from k3jax.train import step as step_lib
from k3jax.train.checkpoint import Checkpointer, save_model
from k3jax.train.metrics import MetricsWriter, read_records
from sharding import distributed
from sharding.mesh import describe, make_mesh
from sharding.placement import check_batch

# options that fix what a checkpoint and its data position mean: a resume must not change them
_RESUME_KEYS = ("data", "data_mix", "data_format", "tokenizer", "seq_len", "batch_size", "seed",
                "init_from", "data_shards", "lora_rank", "lora_alpha", "lora_targets",
                "base_experts", "experts_qat")
# path-valued options: a run records them absolute (a later command may run elsewhere)
_PATHS = {"data": absolute, "data_mix": absolute, "init_from": absolute,
          "tokenizer": absolute_tokenizer}


@dataclasses.dataclass(frozen=True)
class RunOptions:
  out: str
  config: str | None = None          # preset or config file (default "tiny"); not with init_from
  init_from: str | None = None       # converted Orbax checkpoint or official-layout HF folder
  steps: int = 300
  data: str | None = None            # text file / folder, or a prepared dataset; None: stdlib
  data_mix: str | None = None        # mix.json: a mixture of prepared datasets (not with data)
  data_workers: int = 0              # Grain worker processes packing prepared data (0: a thread)
  data_format: str = "text"          # text | chat (JSONL conversations, assistant tokens only)
  skip_bad_rows: bool = False        # chat: train on the good rows (else bad rows refuse the run)
  tokenizer: str = "auto"            # auto | byte | tiktoken | a folder holding tiktoken.model
  batch_size: int = 4                # rows per optimizer step
  grad_accum: int = 1                # micro-batches per step (batch_size % grad_accum == 0)
  seq_len: int = 128
  learning_rate: float = 1e-2
  adam_learning_rate: float | None = None
  warmup_steps: int = 20
  decay_steps: int | None = None     # cosine horizon; default: steps
  end_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float | None = 1.0
  qb: bool = True
  qb_method: str = "exact"
  qb_rule: str = "k3"                # QB thresholds: "k3" (the K3 report's) | "per_expert"
  qk_clip: float | None = None       # MuonClip threshold (K2: 100); None: off
  remat: str = "none"                # none | full | save-dots | offload (execution.Remat)
  loss_chunk: int | None = None      # positions per loss chunk (None: whole logits)
  attention: str | None = None       # MLA's training attention (None: dense)
  capacity_factor: float | None = None  # routed experts' capacity (None: dropless)
  dtype: str = "auto"                # compute dtype; auto: bfloat16 on TPU/GPU, float32 on CPU;
                                     #   float64: float64 weights and compute (exactness checks)
  mesh: str | None = None            # device mesh spec, e.g. "data=2,expert=2,tensor=2"
  data_shards: int = 1               # data pipelines of the run (never the process count)
  coordinator: str | None = None     # multi-process: HOST:PORT of process 0, or "auto"
  num_processes: int | None = None
  process_id: int | None = None
  startup_timeout: float = 3600.0    # seconds a process waits for the others to compile
  eval_every: int = 50
  eval_batches: int = 4
  save_every: int = 100
  keep: int = 3
  log_every: int = 1
  seed: int = 0
  peak_tflops: float | None = None   # for MFU; None: measured (dense matmul) at start-up
  progress: bool = True
  tensorboard: bool = True
  plots: bool = True
  compile_cache: str | None = None   # persistent XLA compilation cache folder
  # fine-tuning (docs/training.md#fine-tuning; model/lora.py)
  lora_rank: int | None = None       # LoRA adapters of this rank, the base frozen; None: off
  lora_alpha: float | None = None    # adapter update scale alpha / rank (default: rank)
  lora_targets: tuple[str, ...] | None = None  # projection path patterns (default: lora.py)
  base_experts: str = "float"        # float | mxfp4: routed experts held as MXFP4 codes
  experts_qat: bool = False          # routed experts forward with MXFP4-rounded weights


def step_config(opts: RunOptions) -> step_lib.StepConfig:
  if opts.batch_size % opts.grad_accum:
    raise UserError(f"--batch-size {opts.batch_size} is not a multiple of --grad-accum "
                    f"{opts.grad_accum}")
  return step_lib.StepConfig(
      learning_rate=opts.learning_rate, adam_learning_rate=opts.adam_learning_rate,
      warmup_steps=opts.warmup_steps, decay_steps=opts.decay_steps or opts.steps,
      end_lr_ratio=opts.end_lr_ratio, weight_decay=opts.weight_decay, clip_norm=opts.clip_norm,
      qb=opts.qb, qb_method=opts.qb_method, qb_rule=opts.qb_rule)


def master_dtype(opts: RunOptions) -> str:
  return "float64" if opts.dtype == "float64" else "float32"


def adapt_spec(opts: RunOptions, cfg: ModelConfig):
  """The AdaptSpec of the run (None: plain training), checked against the model."""
  if opts.lora_rank is None and (opts.lora_alpha is not None or opts.lora_targets):
    raise UserError("--lora-alpha and --lora-targets need --lora RANK")
  if opts.lora_rank is None and opts.base_experts == "float" and not opts.experts_qat:
    return None
  if opts.lora_rank is not None and opts.lora_rank <= 0:
    raise UserError(f"--lora RANK must be > 0, got {opts.lora_rank}")
  if opts.lora_rank is not None and opts.qk_clip is not None:
    raise UserError("--qk-clip rescales base weights, which --lora keeps frozen")
  if opts.base_experts not in ("float", "mxfp4"):
    raise UserError(f"--base-experts {opts.base_experts!r}: expected float or mxfp4")
  if (opts.base_experts == "mxfp4" or opts.experts_qat) and not cfg.moe_layers:
    raise UserError("--base-experts mxfp4 / --experts-qat: the model has no routed experts")
  spec = lora.AdaptSpec(rank=opts.lora_rank, alpha=opts.lora_alpha,
                        targets=tuple(opts.lora_targets or lora.DEFAULT_TARGETS),
                        base_experts=opts.base_experts, qat=opts.experts_qat)
  if spec.lora:
    try:
      lora.matching(spec, nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    except ValueError as e:
      raise UserError(str(e)) from None
  return spec


def execution(opts: RunOptions) -> Execution:
  """How the run computes: bf16 (or fp32) compute over fp32 master weights (fp64 over fp64
  when asked); remat, loss chunks, MLA's attention and the experts' capacity (the knobs
  `k3jax plan` searches and prints as train flags)."""
  knobs = {"loss_chunk": opts.loss_chunk, "attention": opts.attention,
           "moe_capacity_factor": opts.capacity_factor}
  try:
    return Execution(dtype=resolve_dtype(opts.dtype), param_dtype=master_dtype(opts),
                     remat=opts.remat, **{k: v for k, v in knobs.items() if v})  # 0: off
  except ConfigError as e:
    raise UserError(str(e)) from None


def load_init(path: str, ex: Execution, shardings: dict | None = None):
  """(model, cfg) from a converted checkpoint or an official-layout folder, run as `ex` says.
  `shardings` (k3jax path -> NamedSharding) makes Orbax restore a checkpoint's arrays into
  their shards; an official-layout folder is read into host memory (convert it first for big
  models)."""
  if not os.path.isdir(path):
    raise UserError(f"--init-from {path}: no such folder")
  if convert_load.is_checkpoint(path):
    return convert_load.load_checkpoint(path, ex, shardings=shardings)
  if os.path.exists(os.path.join(path, "config.json")):
    return load_model(path, ex)
  raise UserError(f"--init-from {path}: neither a k3jax checkpoint (k3jax_config.json) nor an "
                  "official-layout model folder (config.json)")


def _model_config(opts: RunOptions) -> ModelConfig:
  return model_config(opts.init_from, opts.config)


def model_config(init_from: str | None, config: str | None = None) -> ModelConfig:
  """The architecture of `--init-from` (a model folder of any kind; folders.py), else of the
  preset or config file `config` (default tiny)."""
  if init_from and not os.path.isdir(init_from):
    raise UserError(f"--init-from {init_from}: no such folder")
  if init_from:
    weights = model_folder(init_from).weights
    if convert_load.is_checkpoint(weights):
      cfg = convert_load.checkpoint_config(weights)
    else:
      cfg = configs.resolve(weights)
  else:
    cfg = configs.resolve(config or "tiny")
  return cfg


def check_resume(out: str, opts, cfg: ModelConfig, ex: Execution,
                 keys: tuple[str, ...] = _RESUME_KEYS, paths: dict = _PATHS) -> None:
  """Refuse to continue the run in `out` with another model, execution or any of the option
  `keys` changed (`opts`: RunOptions, or another options dataclass: its class defaults stand
  for options older runs did not record; `paths`: options recorded absolute)."""
  path = os.path.join(out, RUN_FILE)
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f)
  if _normalised(saved.get("model")) != cfg.to_dict() or _saved_execution(saved) != ex:
    raise UserError(f"{out} holds a run of another model config; use a new --out")
  for key in keys:
    was = saved["options"].get(key, getattr(type(opts), key, None))  # runs before the option
    if key in paths and was is not None:  # older runs recorded them as typed
      was = paths[key](was)
    now = getattr(opts, key)
    if was != (list(now) if isinstance(now, tuple) else now):  # JSON keeps tuples as lists
      raise UserError(f"{out} holds a run with --{key.replace('_', '-')} "
                      f"{was!r} (now {getattr(opts, key)!r}); "
                      "resuming must keep it, or use a new --out")


def _normalised(model: dict | None) -> dict | None:
  """A saved model config as this version writes it (older runs saved the execution fields
  in it too)."""
  try:
    return ModelConfig.from_dict(model).to_dict()
  except Exception:  # noqa: BLE001 - not a config this version reads: a mismatch
    return model


def _saved_execution(saved: dict) -> Execution | None:
  """The execution a run file records ("execution"; older runs: inside "model", with remat
  as a bool)."""
  try:
    return recorded({"config": saved.get("model"), **saved})
  except Exception:  # noqa: BLE001 - not one this version reads: a mismatch
    return None


def write_run_file(out: str, opts, cfg: ModelConfig, ex: Execution,
                   data: dict | None = None) -> None:
  """run.json; `data`: the identity of the training data (train/inputs.py)."""
  with open(os.path.join(out, RUN_FILE), "w") as f:
    json.dump({"options": dataclasses.asdict(opts), "model": cfg.to_dict(),
               "execution": ex.to_dict(), **({"data": data} if data else {})}, f, indent=1)


def _eval_loss(steps, state, batches) -> float:
  total, tokens = 0.0, 0
  for batch in batches:
    s, n = steps.eval(state["params"], state["router_bias"], batch)
    total, tokens = total + float(s), tokens + int(n)
  return total / max(tokens, 1)


def _compile_then_meet(steps, state, batch, eval_batch, qk_threshold, timeout_s: float) -> None:
  """Compile the train and eval steps (their first calls reuse the executables), then wait for
  every process: a first collective must not start while another process still compiles (on
  CPU gloo gives a peer 30 s to join; docs/sharding.md#multi-host)."""
  steps.train.lower(state, batch, qk_threshold).compile()
  steps.eval.lower(state["params"], state["router_bias"], eval_batch).compile()
  distributed.barrier("k3jax-train-compiled", timeout_s)


def run(opts: RunOptions, *, on_step=None) -> dict[str, Any]:
  """Train; returns a summary. `on_step(step, record)` is called after each logged step."""
  with jax.enable_x64(True) if opts.dtype == "float64" else contextlib.nullcontext():
    return _run(opts, on_step)


def _path_shardings(steps: step_lib.Steps) -> dict:
  """k3jax variable path (tuple of str) -> NamedSharding, for convert.load's restore target."""
  out = {}
  for tree in (steps.shardings["params"], steps.shardings["router_bias"]):
    for path, sh in jax.tree_util.tree_flatten_with_path(tree)[0]:
      out[tuple(str(k.key) for k in path)] = sh
  return out


def initial_params(steps: step_lib.Steps, cfg: ModelConfig, ex: Execution, spec,
                   init: str | None, seed: int) -> tuple[Any, Any]:
  """(params, router_bias) a run starts from, placed: the weights folder `init` loaded and
  adapted as `spec` asks (MXFP4 packing, fresh adapters from `seed`), else a fresh model from
  `seed`. A resume rebuilds a frozen base with it, bit for bit (train and rl)."""
  mesh = steps.mesh
  if init is None:
    return steps.init_params(seed)  # on a mesh: created in its shardings
  shardings = _path_shardings(steps) if mesh is not None and spec is None else None
  _, params, bias = step_lib.split_model(load_init(init, ex, shardings)[0])
  if spec is not None:
    params = step_lib.adapt_params(cfg, ex, params, bias, spec, seed)
  if mesh is not None:  # an official-layout folder (or an adapted model) arrives whole
    params = jax.device_put(params, steps.shardings["params"])
    bias = jax.device_put(bias, steps.shardings["router_bias"])
  return params, bias


def checkpoint_sizes(step: int, checkpoint_bytes: int, base_bytes: int | None,
                     base: dict | None) -> str:
  """The log line on what the last checkpoint holds next to the base (train and rl)."""
  line = f"checkpoint {step} holds {checkpoint_bytes / 1e6:.3f} MB"
  if base is not None and base["folder"]:
    return line + f", the frozen base it refers to ({base['folder']}) {base_bytes / 1e6:.3f} MB"
  if base is not None:
    return line + " (the frozen base is rebuilt from --seed)"
  return line + (f", --init-from {base_bytes / 1e6:.3f} MB" if base_bytes else "")


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


class _NoWriter:
  """Processes other than 0 write no metrics."""

  def write(self, record) -> None:
    pass

  def close(self) -> None:
    pass


def _run(opts: RunOptions, on_step) -> dict[str, Any]:
  if opts.compile_cache:
    jax.config.update("jax_compilation_cache_dir", opts.compile_cache)
  if opts.steps < 1:
    raise UserError("--steps must be >= 1")
  distributed.initialize(opts.coordinator, opts.num_processes, opts.process_id)
  main_process = distributed.is_main_process()
  if jax.process_count() > 1 and not opts.mesh:
    raise UserError(f"{jax.process_count()} processes need --mesh (e.g. data=-1)")
  mesh = make_mesh(opts.mesh) if opts.mesh else None
  out = os.path.abspath(opts.out)
  opts = dataclasses.replace(opts, **{k: fn(getattr(opts, k)) for k, fn in _PATHS.items()})
  # the data checked before anything is written (a bad manifest or mixture writes no --out)
  chosen = inputs_lib.choose_data(opts.data, opts.data_mix, opts.data_format,
                                  os.path.join(out, RUN_FILE))
  os.makedirs(out, exist_ok=True)
  frozen_base.check_present(out, opts.init_from)
  cfg, ex = _model_config(opts), execution(opts)
  check_resume(out, opts, cfg, ex)
  sc = step_config(opts)
  if mesh is not None:
    check_batch(opts.batch_size // opts.grad_accum, mesh)
  spec = adapt_spec(opts, cfg)
  steps = step_lib.build(cfg, ex, sc, mesh, spec)  # refuses a mesh the model cannot be split on
  pipe = data_lib.PipelineConfig(opts.seq_len, opts.batch_size, opts.grad_accum, opts.seed,
                                 num_shards=opts.data_shards)
  rows, read_shards, write_shards = _process_rows_and_shards(steps, pipe, opts)
  rows_per_micro = opts.batch_size // opts.grad_accum

  ckpt = Checkpointer(os.path.join(out, "checkpoints"), keep=opts.keep)
  resume_step = ckpt.latest_step()
  # a frozen base (LoRA, packed experts) stays out of the checkpoints, referenced by `base`
  frozen = frozen_base.has_frozen(steps.trainable)
  # (a checkpoint without a reference holds the whole state: plain training, older runs)
  base = saved_base = None if resume_step is None else ckpt.base_reference(resume_step)
  if saved_base is not None:  # refuse a changed base before anything is loaded or compiled
    frozen_base.check(saved_base, f"checkpoint {resume_step} of {out}")
  elif frozen:
    base = frozen_base.reference(
        model_folder(opts.init_from).weights if opts.init_from else None, opts.seed)
  source = tokenizer_source(opts.tokenizer, opts.init_from)
  tokenizer = load_tokenizer(source.kind, source.folder)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise UserError(f"the {tokenizer.name} tokenizer has {tokenizer.vocab_size} ids but the "
                    f"model only {cfg.vocab_size} embeddings")
  data = inputs_lib.load_training_data(opts.data, opts.data_format, tokenizer, pipe,
                                     opts.eval_batches, skip_bad_rows=opts.skip_bad_rows,
                                     out=out if main_process else None, mix=chosen.mix,
                                     data_version=chosen.version, workers=opts.data_workers)
  eval_batches = data.eval_batches

  def to_device(batch, rows=rows):
    if mesh is None:
      return batch
    return distributed.global_batch(batch, steps.batch_sharding, rows, rows_per_micro)

  if mesh is not None:  # the held-out set is small and fixed: every process holds all of it
    eval_batches = [to_device(b, (0, rows_per_micro)) for b in eval_batches]

  if resume_step is not None:
    params, bias = jax.eval_shape(lambda: step_lib.init_params(cfg, ex, opts.seed, spec))
    target = step_lib.abstract_state(steps, params, bias)
    if saved_base is not None:
      target = frozen_base.trainable_state(target, steps.trainable)
    state, data_state, meta = ckpt.restore(resume_step, target, read_shards)
    if saved_base is not None:  # the frozen leaves, rebuilt as the run first built them
      params, _ = initial_params(steps, cfg, ex, spec, base["folder"], opts.seed)
      state = frozen_base.with_base(state, params, steps.trainable)
    start = int(state["step"])
  else:
    rng = step_lib.new_rng(opts.seed)
    init = model_folder(opts.init_from).weights if opts.init_from else None
    params, bias = initial_params(steps, cfg, ex, spec, init, opts.seed)
    if mesh is not None:
      rng = np.asarray(rng)  # the same value on every process: replicated by the jit
    state = steps.init(params, bias, rng)
    data_state, meta, start = None, {"tokens_seen": 0, "train_seconds": 0.0}, 0
  if mesh is None:
    # Orbax restores committed arrays; placing a fresh state the same way makes a fresh run
    # and a resumed one lower to the same program (one persistent-cache entry, not two)
    state = step_lib.place(state)
  if main_process:
    write_run_file(out, opts, cfg, ex, chosen.identity)

  flop_count = flops_lib.count(cfg, opts.seq_len)
  tokens_per_step = opts.batch_size * opts.seq_len
  devices = 1 if mesh is None else mesh.size
  peak = devices * (opts.peak_tflops * 1e12 if opts.peak_tflops
                    else flops_lib.measure_matmul_peak(ex.jnp_dtype))
  n_params = step_lib.count_params(state["params"])
  n_trainable = step_lib.count_params(step_lib.partition(state["params"], steps.trainable)[0])
  if main_process:
    print(f"k3jax train: {n_params / 1e6:.2f}M params ({flop_count.active_matmul_params / 1e6:.2f}"
          f"M active matmul), {ex.dtype} compute / {ex.param_dtype} master; "
          f"{data.description} ({tokenizer.name}); batch {opts.batch_size} x {opts.seq_len}"
          f"{f' ({opts.grad_accum} micro-batches)' if opts.grad_accum > 1 else ''}; "
          + (f"mesh {describe(mesh)}, {jax.process_count()} process(es), "
             f"{opts.data_shards} data shard(s); " if mesh is not None else "")
          + (f"resuming from step {start}" if resume_step is not None else "from scratch"
             if not opts.init_from else f"from {opts.init_from}"), flush=True)

  if jax.process_count() > 1:
    print(f"k3jax train: process {jax.process_index()}/{jax.process_count()} supplies rows "
          f"[{rows[0]}, {rows[1]}) of each micro-batch from data shard(s) {read_shards}",
          flush=True)
  writer = (MetricsWriter(out, resume_step=resume_step, tensorboard=opts.tensorboard)
            if main_process else _NoWriter())
  iterator = data.iterator(pipe, rows, data_state)
  bar = tqdm(total=opts.steps, initial=start, disable=not (opts.progress and main_process),
             unit="step", dynamic_ncols=True)
  qk_threshold = step_lib.NO_QK_CLIP if opts.qk_clip is None else np.float32(opts.qk_clip)
  first_loss = last_loss = eval_loss = None
  step_times: list[float] = []
  compile_s = None
  t_prev = time.perf_counter()
  try:
    for s in range(start + 1, opts.steps + 1):
      batch = to_device(next(iterator))
      if s == start + 1 and jax.process_count() > 1:
        _compile_then_meet(steps, state, batch, eval_batches[0], qk_threshold,
                           opts.startup_timeout)
      state, metrics = steps.train(state, batch, qk_threshold)
      metrics = jax.device_get(metrics)
      now = time.perf_counter()
      dt, t_prev = now - t_prev, now
      if compile_s is None:
        compile_s = dt  # the first step of a process includes tracing and compilation
      else:
        step_times.append(dt)
      meta["tokens_seen"] += tokens_per_step
      meta["train_seconds"] += dt
      loss = float(metrics["loss"])
      first_loss = loss if first_loss is None else first_loss
      last_loss = loss
      record = {"step": s, "loss": loss, **metrics, "step_time_s": dt}
      if len(step_times):
        record["tokens_per_s"] = tokens_per_step / dt
        record["mfu"] = flop_count.train_per_token * tokens_per_step / dt / peak
      if s % opts.eval_every == 0 or s == opts.steps:
        eval_loss = _eval_loss(steps, state, eval_batches)
        record["eval_loss"] = eval_loss
        t_prev = time.perf_counter()  # eval time is not step time
      if s % opts.log_every == 0 or "eval_loss" in record or s == opts.steps:
        writer.write(record)
        if on_step is not None:
          on_step(s, record)
      if s % opts.save_every == 0 or s == opts.steps:
        data_states = iterator.get_state()
        ckpt.save(s, frozen_base.trainable_state(state, steps.trainable) if frozen else state,
                  {k: v for k, v in data_states.items() if int(k) in write_shards}, meta,
                  base=base if frozen else None)
        t_prev = time.perf_counter()  # the blocking part of a save is not step time
      bar.update(1)
      bar.set_postfix(loss=f"{loss:.3f}", **({"eval": f"{eval_loss:.3f}"} if eval_loss else {}),
                      **({"tok/s": f"{tokens_per_step / dt:.0f}"} if step_times else {}))
  finally:
    bar.close()
    iterator.close()
    ckpt.wait()  # the last async save completes before the run reports
    saved_steps = ckpt.all_steps()
    checkpoint_bytes = ckpt.step_bytes(saved_steps[-1]) if saved_steps else None
    ckpt.close()
    writer.close()
  if first_loss is not None:  # the final weights, exportable (`k3jax export`) and fine-tunable
    save_model(os.path.join(out, MODEL_DIR), steps.graphdef, state["params"],
               state["router_bias"], cfg, adapters=None if spec is None else spec.to_dict())
  base_bytes = (base["bytes"] if base is not None and base["folder"] else
                weight_bytes(model_folder(opts.init_from).weights) if opts.init_from else None)
  if main_process and checkpoint_bytes is not None:
    sizes = checkpoint_sizes(saved_steps[-1], checkpoint_bytes, base_bytes, base)
    print(f"k3jax train: {sizes}", flush=True)
  plots = []
  if opts.plots and main_process:
    from k3jax.train.plots import write_plots  # noqa: PLC0415 - matplotlib is slow to import; only the end of a run plots
    plots = write_plots(read_records(out), out)
  median = float(np.median(step_times)) if step_times else None
  summary = {
      "out": out, "start_step": start, "steps": opts.steps, "first_loss": first_loss,
      "last_loss": last_loss, "eval_loss": eval_loss, "compile_and_first_step_s": compile_s,
      "median_step_s": median,
      "tokens_per_s": tokens_per_step / median if median else None,
      "mfu": (flop_count.train_per_token * tokens_per_step / median / peak) if median else None,
      "peak_flops": peak, "plots": plots, "checkpoints": saved_steps, "data": data.summary,
      "trainable_params": n_trainable, "total_params": n_params,
      "checkpoint_bytes": checkpoint_bytes, "base_bytes": base_bytes,
  }
  return summary
