"""`k3jax plan`: will a step fit a TPU pod, on which mesh, how fast (docs/plan.md).

The real jitted step is compiled ahead of time for the topology (libtpu on a CPU machine, no
TPU needed) and XLA's own figures are read back: per device the argument / temporary / peak
bytes against the chip's HBM, the compiled matmul FLOPs next to the model FLOPs, and a step
time ESTIMATE (a roofline of peak FLOP/s and HBM bandwidth, no communication), and for a
compiled train / LoRA step the bytes each device sends in its collectives (by kind and mesh
axis) with step-time and MFU bounds (communication overlapped or not). Without --mesh
a small set of meshes is ranked by a hand count and the best few are compiled; --analytic
counts without compiling.

  --mode train   the full train step of `k3jax train` (fp32 master weights, bf16 compute,
                 Per-Head Muon);
  --mode lora    LoRA fine-tuning over a frozen base (`k3jax train --lora RANK`);
  --mode decode  serving, --batch requests of --seq positions: with --analytic the serving
                 engine `k3jax generate` runs on (paged MLA latent, per-slot KDA state, the
                 prefix cache's snapshots, MXFP4 experts kept packed; --max-fit adds the
                 largest batch that fits); compiled, the static batch's prefill and decode
                 programs with bf16 experts (the engine's step is not compiled yet);
  --mode rl      LoRA RL (`k3jax rl --lora RANK`), counted by hand: the LoRA step of --batch
                 rows beside the engine's cache of --batch slots at --seq, on one mesh.

Step flags not given (--grad-accum, --remat, --attention, --loss-chunk, --capacity-factor;
train and lora) are chosen: every combination on every candidate mesh is counted by hand,
ranked by the estimated step time, and the best is compiled (the next only if the compiler
refuses it); the explanation goes to stderr, and the plan ends with the `k3jax train` flags
that run it ("train_args" in JSON).

--json prints one JSON object on the last line (with "candidates" when several plans were
compiled). The planning itself is the library k3jax/plan (`k3jax.plan.run(PlanRequest(...))`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from k3jax import plan
from k3jax.commands._args import (
  Formatter,
  add_lora,
  add_remat,
  add_step_knobs,
  nonneg_int,
  positive_int,
)
from k3jax.plan import Mode, PlanRequest
from k3jax.plan.request import Experts, Serving


def request_from_args(args: argparse.Namespace) -> PlanRequest:
  return PlanRequest(
      config=args.config, topology=args.topology, mode=Mode(args.mode), mesh=args.mesh,
      batch=args.batch, seq=args.seq, grad_accum=args.grad_accum, analytic=args.analytic,
      max_compiles=args.max_compiles, capacity_factor=args.capacity_factor, remat=args.remat,
      loss_chunk=args.loss_chunk, attention=args.attention, lora_rank=args.lora,
      lora_targets=tuple(args.lora_targets) if args.lora_targets else None,
      base_experts=args.base_experts, prefill_chunk=args.prefill_chunk, block=args.block,
      serving=args.serving, experts=args.experts, page_size=args.page_size,
      num_pages=args.num_pages, prefix_snapshots=args.prefix_snapshots, max_fit=args.max_fit,
      data_shards=args.data_shards)


def run(args: argparse.Namespace) -> int:
  plans = plan.run(request_from_args(args))
  chosen = plan.best(plans)
  if args.json:
    out = chosen.to_json()
    if len(plans) > 1:
      out["candidates"] = [p.to_json() for p in plans]
    print(json.dumps(out))
    return 0
  if len(plans) > 1:
    for p in plans:
      print(p.report())
    fit = getattr(chosen, "max_fit_batch", None)
    fits = (f"fits {fit} slots at --seq" if fit else "fits" if chosen.fits else
            "nothing fits")
    print(f"best: mesh {chosen.mesh} ({fits})")
  else:
    print(chosen.report())
  if getattr(chosen, "train_args", None):
    print("train with: k3jax train " + shlex.join(chosen.train_args) + " --out DIR --data ...")
  sys.stdout.flush()
  return 0


def register(sub) -> None:
  p = sub.add_parser("plan", help="compile the train or decode step for a TPU topology: memory, "
                     "FLOPs, time estimate", description=__doc__, formatter_class=Formatter)
  p.add_argument("--config", required=True, help="preset, HF config.json or k3jax config JSON")
  p.add_argument("--topology", required=True,
                 help="TPU topology as get_topology_desc takes it: v5e:2x2, v5p:8x8x16, "
                 "tpu7x:8x8x8, ...")
  p.add_argument("--mesh", help="data=..,fsdp=..,expert=..,tensor=.. (none given: search)")
  p.add_argument("--batch", type=positive_int, default=None,
                 help="global rows per step (none given: one per device)")
  p.add_argument("--seq", type=positive_int, default=8192,
                 help="sequence length (--mode decode: cache positions per row)")
  p.add_argument("--grad-accum", type=positive_int, default=None,
                 help="micro-batches per step (none given: chosen, --mode train|lora)")
  p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.TRAIN.value,
                 help="train: the full train step; lora: LoRA fine-tuning over a frozen base "
                 "(k3jax train --lora); decode: serving (k3jax generate: prefill and decode "
                 "with a cache of --batch rows x --seq positions)")
  add_lora(p, rank=16, base_experts="mxfp4", when="--mode lora: ")
  add_remat(p, default=None)
  add_step_knobs(p, whole="0", searched=True)
  p.add_argument("--prefill-chunk", type=positive_int, default=512,
                 help="--mode decode: prompt tokens per prefill call (as k3jax generate)")
  p.add_argument("--block", type=positive_int, default=8,
                 help="--mode decode: decode steps per jitted call (as k3jax generate)")
  p.add_argument("--serving", choices=[v.value for v in Serving], default=None,
                 help="--mode decode: engine (the serving engine: paged latent, per-slot KDA "
                 "state; --analytic only) or static (the static left-padded batch); none "
                 "given: engine with --analytic, static compiled")
  p.add_argument("--experts", choices=[v.value for v in Experts], default=None,
                 help="--mode decode: routed experts served packed (mxfp4: codes + E8M0 "
                 "scales, 4.25 bits a weight; --analytic only) or dequantized to bf16; none "
                 "given: mxfp4 for the engine, dequantized for the static batch")
  p.add_argument("--page-size", type=positive_int, default=64,
                 help="--serving engine: positions per MLA latent page")
  p.add_argument("--num-pages", type=positive_int, default=None,
                 help="--serving engine: latent pages in the pool (none given: every slot "
                 "at --seq)")
  p.add_argument("--data-shards", type=positive_int, default=None, metavar="N",
                 help="--serving engine: the slot, snapshot and page pools split into N "
                 "shards over the batch axes (the engine's --data-shards; none given: the "
                 "mesh's data x fsdp x expert devices, each holding one shard; 1: one pool "
                 "whole on every device)")
  p.add_argument("--prefix-snapshots", type=nonneg_int, default=None, metavar="N",
                 help="--serving engine: the prefix cache's KDA state snapshots held (none "
                 "given: the engine's default, 2 per slot; --prefix-state-every sets how "
                 "often they are taken, not how many are held)")
  p.add_argument("--max-fit", action="store_true",
                 help="--serving engine --analytic: also the largest --batch that fits at "
                 "--seq on each mesh")
  p.add_argument("--analytic", action="store_true", help="hand count, no compile")
  p.add_argument("--max-compiles", type=positive_int, default=None,
                 help="compile this many of the best candidates and report the fastest that "
                 "fits (none given: the best, and the next only if the compiler refuses it, "
                 "at most 3; with every step flag given: the best 3 meshes)")
  p.add_argument("--json", action="store_true", help="one JSON object")
  p.set_defaults(func=run)
