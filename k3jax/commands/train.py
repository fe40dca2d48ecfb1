"""`k3jax train`: train or fine-tune a K3-family model (docs/training.md).

Embedded default: `k3jax train --config tiny --steps 300 --out DIR` trains the tiny K3-shaped
preset byte-level on this interpreter's standard-library sources (no download). The same
command with a larger --steps resumes from DIR's last checkpoint. --init-from fine-tunes a
converted checkpoint (`k3jax convert`) or an official-layout model folder, with the folder's
tiktoken tokenizer when it has one. `--format chat --data FILE.jsonl` is chat SFT: rows of
{"messages": [...], "tools": [...]} rendered with the folder's chat template, the loss on
assistant tokens only (`k3jax tokenize MODEL_DIR --chat ROW.json` shows what is trained).
`--data DIR` of `k3jax prepare-data` (or `--data-mix mix.json`, a weighted mixture of such
folders) trains on a prepared dataset: each process reads only the documents its rows need,
lazily (docs/training.md#data-at-scale).

Scale-out (docs/sharding.md): --mesh data=2,fsdp=1,expert=2,tensor=2 runs the step sharded over the
devices (axes left out have size 1; one axis may be -1: the devices left over; the sizes must
multiply to the device count). Several processes (hosts): start the same command on each with
--coordinator HOST:PORT --num-processes N --process-id I (on Cloud TPU the environment
provides them: nothing to add, or --coordinator auto); every process reads the same global
batch stream and keeps its rows (the batches never depend on the process count), saves and
restores its own checkpoint shards, and process 0 writes the metrics.
"""

from __future__ import annotations

import argparse
import json

import jax

from k3jax.commands._args import (
  Formatter,
  add_lora,
  add_processes,
  add_remat,
  add_step_knobs,
  default_compile_cache,
  nonneg_float,
  nonneg_int,
  optional_float,
  positive_float,
  positive_int,
)
from k3jax.errors import UserError
from k3jax.train.loop import RunOptions
from k3jax.train.loop import run as run_training
from k3jax.train.step import Schedule


def step_range(text: str) -> tuple[int, int]:
  """'A:B' -> (A, B), 1 <= A <= B."""
  try:
    a, b = (int(x) for x in text.split(":"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected A:B (two step numbers), got {text!r}") from None
  if not 1 <= a <= b:
    raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text}")
  return a, b


def options_from_args(args: argparse.Namespace):
  if args.config and args.init_from:
    raise UserError("--config and --init-from are exclusive: a checkpoint brings its config")
  cache = None if args.compile_cache.lower() == "none" else args.compile_cache
  return RunOptions(
      out=args.out, config=args.config, init_from=args.init_from, steps=args.steps,
      new_stage=args.new_stage,
      data=args.data, data_mix=args.data_mix, data_workers=args.data_workers,
      data_format=args.format, skip_bad_rows=args.skip_bad_rows,
      tokenizer=args.tokenizer, batch_size=args.batch_size,
      grad_accum=args.grad_accum, seq_len=args.seq_len, learning_rate=args.lr,
      adam_learning_rate=args.adam_lr, warmup_steps=args.warmup, decay_steps=args.decay_steps,
      end_lr_ratio=args.end_lr_ratio, schedule=args.schedule, decay_frac=args.decay_frac,
      z_loss=args.z_loss, weight_decay=args.weight_decay, clip_norm=args.clip,
      qb=not args.no_qb, qb_method=args.qb_method, qb_rule=args.qb_rule,
      qk_clip=args.qk_clip, remat=args.remat, loss_chunk=args.loss_chunk,
      attention=args.attention, capacity_factor=args.capacity_factor, mesh=args.mesh,
      data_shards=args.data_shards,
      coordinator=args.coordinator, num_processes=args.num_processes,
      process_id=args.process_id, startup_timeout=args.startup_timeout,
      step_timeout=args.step_timeout,
      dtype=args.dtype, eval_every=args.eval_every, eval_batches=args.eval_batches,
      save_every=args.save_every, save_every_minutes=args.save_every_minutes,
      keep=args.keep, log_every=args.log_every, seed=args.seed,
      peak_tflops=args.peak_tflops, profile_steps=args.profile_steps,
      progress=not args.no_progress,
      tensorboard=not args.no_tensorboard, plots=not args.no_plots, compile_cache=cache,
      **_fine_tuning_options(args))


def _fine_tuning_options(args: argparse.Namespace) -> dict:
  return {"lora_rank": args.lora, "lora_alpha": args.lora_alpha,
          "lora_targets": tuple(args.lora_targets) if args.lora_targets else None,
          "base_experts": args.base_experts, "experts_qat": args.experts_qat}


def run(args: argparse.Namespace) -> int:
  summary = run_training(options_from_args(args))
  if jax.process_index() != 0:  # one report per run, from process 0
    return 0
  if summary["preempted"] is not None:  # the run said so in one line: saved, resumable
    pass
  elif summary["first_loss"] is None:
    print(f"nothing to do: {summary['out']} is already at step {summary['start_step']} "
          f"(raise --steps to train on)")
  else:
    mfu = summary["mfu"]
    peak = {"chip": "the chip's dense bf16", "flag": "--peak-tflops'",
            "measured": "a measured matmul"}[summary["peak_source"]]
    print(f"steps {summary['start_step']}->{summary['steps']}: loss {summary['first_loss']:.4f}"
          f" -> {summary['last_loss']:.4f}, eval {summary['eval_loss']:.4f}; compile + first "
          f"step {summary['compile_and_first_step_s']:.1f}s"
          + (f", {summary['tokens_per_s']:.0f} tokens/s, MFU {100 * mfu:.1f}% of {peak} "
             f"peak ({summary['peak_flops'] / 1e9:.0f} GFLOP/s)" if mfu else "")
          + f"; goodput {100 * summary['goodput']:.0f}% of {summary['wall_s']:.0f}s since "
          "the first start")
    print(f"outputs: {summary['out']} (metrics.jsonl, tb/, plots/, checkpoints/"
          f"{summary['checkpoints'][-1] if summary['checkpoints'] else ''})")
  if args.json:
    print(json.dumps(summary))
  return 0


def register(sub) -> None:
  p = sub.add_parser("train", help="train or fine-tune (Per-Head Muon, Quantile Balancing)",
                     description=__doc__, formatter_class=Formatter)
  g = p.add_argument_group("run")
  g.add_argument("--out", required=True, help="run folder (created; resumed if it has one)")
  g.add_argument("--config", default=None,
                 help="preset (tiny, k3, ...) or config JSON (none given: tiny)")
  g.add_argument("--init-from", default=None, metavar="CKPT",
                 help="fine-tune: a converted k3jax checkpoint, an official-layout folder or "
                      "a `k3jax train` output")
  g.add_argument("--steps", type=positive_int, default=300, help="train until this step")
  g.add_argument("--seed", type=int, default=0, help="init and data-order seed")
  g.add_argument("--new-stage", action="store_true",
                 help="resume OUT as a new stage: --seq-len, --batch-size, --data, "
                      "--data-mix and the schedule may change; parameters, optimizer state "
                      "and step continue, and the data continues where it was for a source "
                      "(a prepared component: by fingerprint) in both stages")
  g = p.add_argument_group("data")
  g.add_argument("--data", default=None,
                 help="a prepared dataset (k3jax prepare-data's folder), a text file or folder "
                      "(none given: this Python's standard-library sources); --format chat: "
                      "a .jsonl file or folder of them")
  g.add_argument("--data-mix", default=None, metavar="MIX.json",
                 help="a mixture of prepared datasets: {\"components\": [{\"path\": DIR, "
                      "\"weight\": w}, ...]} (shares of documents; \"shares\": \"tokens\" "
                      "for tokens); not with --data")
  g.add_argument("--data-workers", type=nonneg_int, default=0, metavar="N",
                 help="prepared data: Grain worker processes packing rows (0: one thread); "
                      "the batches are the same for any N, so a resume may change it")
  g.add_argument("--format", choices=("text", "chat"), default="text",
                 help="text: documents, every token trained; chat: JSONL rows {\"messages\": "
                      "[...], \"tools\": [...]} rendered with the checkpoint's chat template, "
                      "assistant tokens trained")
  g.add_argument("--skip-bad-rows", action="store_true",
                 help="chat: train on the good rows, listing the bad ones in OUT/bad_rows.jsonl"
                      " (default: bad rows refuse the run)")
  g.add_argument("--tokenizer", default="auto", metavar="auto|byte|tiktoken|FOLDER",
                 help="auto: the --init-from folder's tiktoken.model if any, else bytes; "
                      "FOLDER: a model folder's tokenizer (tiktoken.model, tokenizer_config.json)")
  g.add_argument("--batch-size", type=positive_int, default=4, help="rows per step")
  g.add_argument("--seq-len", type=positive_int, default=128, help="positions per row")
  g.add_argument("--grad-accum", type=positive_int, default=1,
                 help="micro-batches per step (divides --batch-size)")
  g = p.add_argument_group("optimizer (Per-Head Muon + AdamW)")
  g.add_argument("--lr", type=positive_float, default=1e-2, help="Muon peak learning rate")
  g.add_argument("--adam-lr", type=positive_float, default=None,
                 help="AdamW peak learning rate (none given: --lr); under --lora the adapters' "
                      "(LoRA recipes use ~1e-4 to 2e-4)")
  g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
  g.add_argument("--schedule", choices=[s.value for s in Schedule], default="cosine",
                 help="after the warm-up: cosine to --end-lr-ratio at --decay-steps; wsd: "
                      "stable at the peak, then a cosine decay over the last --decay-frac of "
                      "--decay-steps; constant: the peak")
  g.add_argument("--decay-steps", type=positive_int, default=None,
                 help="the schedule's horizon (none given: --steps)")
  g.add_argument("--decay-frac", type=float, default=0.2, metavar="F",
                 help="wsd: the fraction of --decay-steps that decays, in (0, 1]")
  g.add_argument("--end-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
  g.add_argument("--z-loss", type=nonneg_float, default=0.0, metavar="W",
                 help="add W * logsumexp(logits)^2 per loss token to the loss (logged as "
                      "z_loss; PaLM used 1e-4); 0: off")
  g.add_argument("--weight-decay", type=float, default=0.1)
  g.add_argument("--clip", type=optional_float, default=1.0,
                 help="clip the global gradient norm (none: off)")
  g.add_argument("--qk-clip", type=optional_float, default=None, metavar="TAU",
                 help="MuonClip QK-clip threshold for MLA (K2: 100; default off)")
  g.add_argument("--no-qb", action="store_true", help="freeze the router bias (no QB)")
  g.add_argument("--qb-method", choices=("exact", "histogram"), default="exact",
                 help="Quantile Balancing estimator: exact (sort; gathers the rows on a mesh) "
                      "or histogram (one psum of [E, bins] counts)")
  g.add_argument("--qb-rule", choices=("k3", "per_expert"), default="k3",
                 help="QB threshold: k3 (the K3 report's formula: the (k+1)-th biased score for "
                      "every pair) or per_expert (the exact per-pair threshold)")
  g = p.add_argument_group("fine-tuning (LoRA, MXFP4 experts)")
  add_lora(g, rank=None, base_experts="float")
  g.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                 help="scale the adapter update by A / RANK (default: A = RANK)")
  g.add_argument("--experts-qat", action="store_true",
                 help="routed experts forward with their MXFP4-rounded weights "
                      "(straight-through gradients): the exported MXFP4 model computes "
                      "what was trained")
  g = p.add_argument_group("numerics and speed")
  g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float64"), default="auto",
                 help="compute dtype over fp32 master weights (auto: bf16 on TPU/GPU, fp32 "
                      "on CPU); float64: fp64 weights and compute, for exactness checks")
  add_remat(g, default="none", bare="full")
  add_step_knobs(g, whole="0")
  g.add_argument("--peak-tflops", type=positive_float, default=None,
                 help="one device's peak for MFU (none given: the chip table's dense bf16 "
                      "peak for TPUs and NVIDIA H100 / H200, else a dense matmul measured at "
                      "start-up)")
  g.add_argument("--profile-steps", type=step_range, default=None, metavar="A:B",
                 help="write a jax.profiler trace of steps A to B per process under "
                      "OUT/profile/ (TensorBoard's profile plugin, Perfetto)")
  g.add_argument("--compile-cache", default=default_compile_cache(),
                 help="persistent XLA compilation cache folder (none: off)")
  g = p.add_argument_group("scale-out (devices and hosts)")
  g.add_argument("--mesh", default=None, metavar="MESH",
                 help="device mesh, e.g. data=2,expert=2,tensor=2 (axes data, fsdp, expert, "
                      "tensor; omitted axes 1; one may be -1); none given: one device")
  g.add_argument("--data-shards", type=positive_int, default=1,
                 help="independent data pipelines of the run, each supplying 1/N of every "
                      "micro-batch's rows; never tied to the process count; a resume keeps it")
  add_processes(g, what="each supplies its devices' rows of every batch",
                compiled="the train step")
  g.add_argument("--step-timeout", type=positive_float, default=None, metavar="SECONDS",
                 help="watchdog: a step, eval or save not done in this time ends the process "
                      "(exit 75: restart to resume) (none given: 10x the slowest recent step, "
                      "at least 300 s)")
  g = p.add_argument_group("eval, logging, checkpoints")
  g.add_argument("--eval-every", type=positive_int, default=50)
  g.add_argument("--eval-batches", type=positive_int, default=4)
  g.add_argument("--log-every", type=positive_int, default=1)
  g.add_argument("--save-every", type=positive_int, default=100)
  g.add_argument("--save-every-minutes", type=positive_float, default=None, metavar="M",
                 help="also save once M minutes passed since the last save (process 0's clock; "
                      "every process saves the same step)")
  g.add_argument("--keep", type=positive_int, default=3, help="checkpoints kept")
  g.add_argument("--no-progress", action="store_true", help="no progress bar")
  g.add_argument("--no-tensorboard", action="store_true")
  g.add_argument("--no-plots", action="store_true")
  g.add_argument("--json", action="store_true", help="also print the summary as JSON")
  p.set_defaults(func=run)
