"""`k3jax rl`: reinforcement learning with verifiable rewards (docs/rl.md).

Each step draws --prompts-per-step prompts from --data (JSONL rows with `prompt` or `messages`,
plus the fields the reward reads), samples --group-size completions of each on the serving
engine over the policy's current weights, scores them with --reward, and takes
--updates-per-step optimizer steps on the group-relative policy-gradient objective (GRPO,
Dr. GRPO or GSPO; DAPO's clip-higher, dynamic sampling and overlong masking as flags).

--reward is a built-in verifier (numeric, exact, regex:PATTERN, length:CACHE) or a user
function module:function / path/file.py:function called as fn(prompt, completion, row) ->
float in its own process; repeat it to sum terms, `0.5*regex:...` weighs one. A reward that
raises, returns no finite number or runs past --reward-timeout scores 0, is logged to
OUT/reward_errors.jsonl and counted in the metrics; the run goes on.

MODEL (--init-from) is any folder `k3jax generate` takes, a `k3jax train` or `k3jax rl`
output included. OUT gets metrics.jsonl (one line per step), checkpoints/ (the same command
resumes from the last one, exactly), plots/rl.png, tb/, and model/ (`k3jax generate OUT`).

Several processes (hosts): start the same command on each with --mesh and --coordinator
HOST:PORT --num-processes N --process-id I, as `k3jax train`; every process draws the same
prompts and samples the same completions on the engine over the global mesh, process 0 scores
them and hands the rewards to the others, and process 0 writes the metrics.
"""

from __future__ import annotations

import argparse
import json

from k3jax.commands._args import (
  DTYPES,
  Formatter,
  add_lora,
  add_processes,
  add_remat,
  default_compile_cache,
  io_errors_are_user_errors,
  optional_float,
)
from k3jax.rl import objectives
from k3jax.rl.loop import RLOptions
from k3jax.rl.loop import run as run_rl


def options_from_args(args: argparse.Namespace) -> RLOptions:
  cache = None if args.compile_cache.lower() == "none" else args.compile_cache
  return RLOptions(
      init_from=args.init_from, data=args.data, reward=tuple(args.reward or ()),
      group_size=args.group_size, steps=args.steps, out=args.out,
      prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
      temperature=args.temperature, updates_per_step=args.updates_per_step,
      algorithm=args.algorithm, loss_agg=args.loss_agg, clip_eps=args.clip_eps,
      clip_higher=args.clip_higher, kl_coef=args.kl_coef,
      dynamic_sampling=args.dynamic_sampling, mask_truncated=args.mask_truncated,
      reward_timeout=args.reward_timeout, learning_rate=args.learning_rate,
      adam_learning_rate=args.adam_learning_rate, warmup_steps=args.warmup_steps,
      weight_decay=args.weight_decay, clip_norm=args.clip_norm, grad_accum=args.grad_accum,
      lora_rank=args.lora, lora_alpha=args.lora_alpha,
      lora_targets=tuple(args.lora_targets) if args.lora_targets else None,
      base_experts=args.base_experts, experts_qat=args.experts_qat, dtype=args.dtype,
      remat=args.remat, mesh=args.mesh,
      coordinator=args.coordinator, num_processes=args.num_processes,
      process_id=args.process_id, startup_timeout=args.startup_timeout,
      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=args.seed,
      is_correction=args.is_correction, is_cap=args.is_cap, env=args.env,
      env_args=tuple(args.env_arg), env_timeout=args.env_timeout, max_turns=args.max_turns,
      max_trajectory_tokens=args.max_trajectory_tokens, rollout_budget=args.rollout_budget,
      partial_rollout=args.partial_rollout, max_staleness=args.max_staleness,
      teacher=tuple(args.teacher), distill_weight=args.distill_weight,
      distill_baseline=args.distill_baseline,
      save_every=args.save_every, keep=args.keep, tensorboard=not args.no_tensorboard,
      plots=not args.no_plots, progress=not (args.no_progress or args.json),
      compile_cache=cache)


@io_errors_are_user_errors
def run(args: argparse.Namespace) -> int:
  summary = run_rl(options_from_args(args))
  if args.json:  # the last stdout line, for scripts
    print(json.dumps(summary))
    return 0
  first, last = summary["first"], summary["last"]
  if first is None:
    print(f"nothing to do: {summary['out']} is already at step {summary['start_step']} "
          f"(raise --steps to go on)")
    return 0
  print(f"steps {summary['start_step']}->{summary['steps']}: reward {first['reward_mean']:.3f}"
        f" -> {last['reward_mean']:.3f}, accuracy {first['accuracy']:.3f} -> "
        f"{last['accuracy']:.3f}, kl {last['kl']:.4g}; {summary['rollout_tokens']} tokens "
        f"generated")
  print(f"outputs: {summary['out']} (metrics.jsonl, model/, checkpoints/"
        + (", plots/rl.png" if summary["plots"] else "") + ")")
  return 0


def register(sub) -> None:
  p = sub.add_parser("rl", help="reinforcement learning on verifiable rewards (GRPO family)",
                     description=__doc__, formatter_class=Formatter)
  # counts are plain ints: a bad value is a one-line UserError from the loop's checks
  g = p.add_argument_group("run")
  g.add_argument("--init-from", required=True, metavar="MODEL",
                 help="the policy's initial weights: any folder `k3jax generate` takes")
  g.add_argument("--data", required=True, metavar="PROMPTS.jsonl",
                 help="rows {\"prompt\": ...} or {\"messages\": [...]} plus the reward's "
                      "fields (`answer` for numeric / exact)")
  g.add_argument("--reward", action="append", metavar="NAME_OR_FN",
                 help="numeric | exact | regex:PATTERN | length:CACHE | module:fn | "
                      "file.py:fn, optionally WEIGHT*...; repeatable (the terms are summed; "
                      "scored on a trajectory's last turn). Required without --env / "
                      "--teacher")
  g.add_argument("--group-size", required=True, type=int, metavar="G",
                 help="completions per prompt (>= 2)")
  g.add_argument("--steps", required=True, type=int, metavar="N",
                 help="RL iterations (the run goes on to this step when resumed)")
  g.add_argument("--out", required=True, metavar="DIR",
                 help="run folder (created; resumed if it has a checkpoint)")
  g.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed")
  g = p.add_argument_group("rollouts and rewards")
  g.add_argument("--prompts-per-step", type=int, default=8, metavar="B")
  g.add_argument("--max-new-tokens", type=int, default=64, metavar="T")
  g.add_argument("--temperature", type=float, default=1.0,
                 help="sampling temperature; the policy is softmax(logits / T)")
  g.add_argument("--reward-timeout", type=float, default=30.0, metavar="SECONDS",
                 help="a user reward function's time per sample")
  g.add_argument("--max-model-len", type=int, default=None,
                 help="the context (default: the folder's, else 8192); longer prompts are "
                      "skipped and counted")
  g.add_argument("--max-num-seqs", type=int, default=None,
                 help="engine slots (default: every rollout of a step at once)")
  g = p.add_argument_group("environments and trajectories (multi-turn)")
  g.add_argument("--env", default=None, metavar="ENV",
                 help="tools | python | module:Class | path/file.py:Class: each trajectory "
                      "runs in it, turn by turn (none given: one turn scored by --reward)")
  g.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                 help="a keyword argument of the environment's class (JSON, else text); "
                      "repeatable")
  g.add_argument("--env-timeout", type=float, default=60.0, metavar="SECONDS",
                 help="an environment call's time (past it: that trajectory's error)")
  g.add_argument("--max-turns", type=int, default=None,
                 help="assistant turns per trajectory (default: 1 without --env, 32 with)")
  g.add_argument("--max-trajectory-tokens", type=int, default=None, metavar="N",
                 help="a trajectory's tokens at most, prompt and observations included "
                      "(default: the context); past it the trajectory ends, counted")
  g = p.add_argument_group("partial rollouts")
  g.add_argument("--rollout-budget", type=int, default=None, metavar="TOKENS",
                 help="tokens generated a step; trajectories still running are paused and "
                      "continue in the next step, under the new weights")
  g.add_argument("--partial-rollout", choices=("keep", "recompute"), default="keep",
                 help="a paused trajectory continues the state the engine kept (keep) or is "
                      "read again under the new weights (recompute)")
  g.add_argument("--max-staleness", type=int, default=2, metavar="K",
                 help="trajectories started more than K policy versions ago are dropped and "
                      "counted")
  g.add_argument("--is-correction", choices=("none", "tis", "mis"), default="none",
                 help="rollout importance sampling between the engine's logprobs and the "
                      "trainer's old policy: truncated (tis) or masked (mis)")
  g.add_argument("--is-cap", type=float, default=2.0, metavar="C",
                 help="the importance weight's cap (tis) or range [1/C, C] (mis)")
  g = p.add_argument_group("on-policy distillation")
  g.add_argument("--teacher", action="append", default=[], metavar="NAME=MODEL",
                 help="a teacher: a model folder (on the run's mesh) or a `k3jax serve` URL; "
                      "repeatable (rows then name theirs in a `teacher` field)")
  g.add_argument("--distill-weight", type=float, default=1.0, metavar="LAMBDA",
                 help="advantage = LAMBDA (teacher - student logprob) + (1 - LAMBDA) x the "
                      "group reward advantage")
  g.add_argument("--distill-baseline", action="store_true",
                 help="take teacher - student less its mean over the group's sampled tokens "
                      "(a baseline: lower variance, the same expected gradient)")
  g = p.add_argument_group("objective")
  g.add_argument("--algorithm", choices=[a.value for a in objectives.Algorithm],
                 default="grpo")
  g.add_argument("--loss-agg", choices=[a.value for a in objectives.LossAgg], default=None,
                 help="token aggregation (none given: the algorithm's own)")
  g.add_argument("--clip-eps", type=float, default=None,
                 help="eps_low of the ratio clip (none given: 0.2; GSPO 3e-4)")
  g.add_argument("--clip-higher", type=float, default=None, metavar="EPS_HIGH",
                 help="DAPO's clip-higher upper range (none given: symmetric; DAPO: 0.28)")
  g.add_argument("--kl-coef", type=float, default=0.0,
                 help="beta of the k3 KL to the reference policy in the loss (0: none)")
  g.add_argument("--dynamic-sampling", action="store_true",
                 help="DAPO: groups whose rewards are all equal do not train")
  g.add_argument("--mask-truncated", action="store_true",
                 help="DAPO: completions cut at --max-new-tokens do not train")
  g.add_argument("--updates-per-step", type=int, default=1, metavar="U",
                 help="optimizer steps on each step's rollouts")
  g = p.add_argument_group("optimizer (Per-Head Muon + AdamW; AdamW on LoRA adapters)")
  # k3jax train's spellings (--lr, --adam-lr, --warmup, --clip) work too
  g.add_argument("--learning-rate", "--lr", dest="learning_rate", type=float, default=1e-6,
                 help="Muon learning rate")
  g.add_argument("--adam-learning-rate", "--adam-lr", dest="adam_learning_rate", type=float,
                 default=None, help="AdamW learning rate (none given: --learning-rate)")
  g.add_argument("--warmup-steps", "--warmup", dest="warmup_steps", type=int, default=0,
                 help="linear warm-up updates")
  g.add_argument("--weight-decay", type=float, default=0.0)
  g.add_argument("--clip-norm", "--clip", dest="clip_norm", type=optional_float, default=1.0,
                 help="clip the global gradient norm (none: off)")
  g.add_argument("--grad-accum", type=int, default=1,
                 help="micro-batches per update (divides B x G)")
  g = p.add_argument_group("fine-tuning (LoRA, MXFP4 experts)")
  add_lora(g, rank=None, base_experts="float")
  g.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                 help="scale the adapter update by A / RANK (default: A = RANK)")
  g.add_argument("--experts-qat", action="store_true",
                 help="routed experts forward with their MXFP4-rounded weights (straight-"
                      "through gradients); the engine samples from them packed: the rollouts "
                      "come from the model `k3jax export --merge-lora` ships")
  g = p.add_argument_group("numerics, devices")
  g.add_argument("--dtype", choices=DTYPES, default="auto",
                 help="compute dtype (auto: fp32 on CPU, bf16 on TPU/GPU); float64 for "
                      "exactness checks")
  add_remat(g, default="none", bare="full")
  g.add_argument("--mesh", default=None, metavar="MESH",
                 help="device mesh, e.g. data=2,tensor=2 (none given: one device)")
  g.add_argument("--compile-cache", default=default_compile_cache(),
                 help="persistent XLA compilation cache folder (none: off)")
  g = p.add_argument_group("scale-out (hosts)")
  add_processes(g, what="each holds its devices' share; process 0 scores the rewards",
                compiled="the reference logprobs and the train step")
  g = p.add_argument_group("logging, checkpoints")
  g.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
  g.add_argument("--keep", type=int, default=2, help="checkpoints kept")
  g.add_argument("--no-progress", action="store_true", help="no progress bar")
  g.add_argument("--no-tensorboard", action="store_true")
  g.add_argument("--no-plots", action="store_true")
  g.add_argument("--json", action="store_true",
                 help="print the run's summary as one JSON object (the last stdout line); "
                      "no progress bar")
  p.set_defaults(func=run)
