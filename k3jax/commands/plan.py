"""`k3jax plan` on the command line: flags, defaults and output (the planning is k3jax/plan/train.py)."""

from __future__ import annotations

import argparse
import json
import sys

from k3jax import plan
from k3jax.commands._args import positive_int
from k3jax.execution import Attention, Remat


def run(args: argparse.Namespace) -> int:
  from k3jax.plan import decode as plan_decode  # noqa: PLC0415
  lib = plan_decode if args.mode == "decode" else plan
  plans = lib.run_plan(args)
  chosen = plan.best(plans)
  if args.json:
    out = chosen.to_json()
    if len(plans) > 1:
      out["candidates"] = [p.to_json() for p in plans]
    print(json.dumps(out))
    return 0
  if len(plans) > 1:
    for p in plans:
      print(lib.report(p))
    print(f"best: mesh {chosen.mesh} ({'fits' if chosen.fits else 'nothing fits'})")
  else:
    print(lib.report(chosen))
  sys.stdout.flush()
  return 0


def register(sub) -> None:
  p = sub.add_parser("plan", help="compile the train or decode step for a TPU topology: memory, FLOPs, "
                     "time estimate", description=plan.__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="preset, HF config.json or k3jax config JSON")
  p.add_argument("--topology", required=True,
                 help="TPU topology as get_topology_desc takes it: v5e:2x2, v5p:8x8x16, "
                 "tpu7x:8x8x8, ...")
  p.add_argument("--mesh", help="data=..,fsdp=..,expert=..,tensor=.. (default: search)")
  p.add_argument("--batch", type=positive_int, default=None,
                 help="global rows per step (default: the batch-axis device count)")
  p.add_argument("--seq", type=positive_int, default=8192, help="sequence length")
  p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step")
  p.add_argument("--mode", choices=("train", "lora", "decode"), default="train",
                 help="train: the full train step; lora: LoRA fine-tuning over a frozen base "
                 "(k3jax train --lora); decode: serving (k3jax generate: prefill and decode "
                 "with a cache of --batch rows x --seq positions)")
  p.add_argument("--lora", type=int, default=16, metavar="RANK",
                 help="--mode lora: adapter rank (default 16)")
  p.add_argument("--lora-targets", nargs="+", default=None, metavar="PATTERN",
                 help="--mode lora: projection path patterns (default: as k3jax train)")
  p.add_argument("--base-experts", choices=("float", "mxfp4"), default="mxfp4",
                 help="--mode lora: routed experts held as bf16 or MXFP4 codes (default)")
  p.add_argument("--remat", default=None, choices=[r.value for r in Remat],
                 help="remat policy: none | full | save-dots | offload (default: none)")
  p.add_argument("--loss-chunk", type=int, default=None,
                 help="positions per loss chunk (0 or unset: whole logits)")
  p.add_argument("--attention", choices=[a.value for a in Attention], default=None,
                 help="MLA attention (default: dense)")
  p.add_argument("--capacity-factor", type=float, default=None, metavar="F",
                 help="routed experts' capacity factor (default: none, dropless, whose receive "
                      "buffers are sized for the worst case)")
  p.add_argument("--prefill-chunk", type=positive_int, default=512,
                 help="--mode decode: prompt tokens per prefill call (as k3jax generate)")
  p.add_argument("--block", type=positive_int, default=8,
                 help="--mode decode: decode steps per jitted call (as k3jax generate)")
  p.add_argument("--analytic", action="store_true", help="hand count, no compile")
  p.add_argument("--max-compiles", type=positive_int, default=3,
                 help="without --mesh: compile at most this many candidates")
  p.add_argument("--json", action="store_true", help="one JSON object")
  p.set_defaults(func=_run_with_defaults)


def _run_with_defaults(args) -> int:
  if args.batch is None:  # one row per device: every mesh's batch axes divide it
    args.batch = len(plan.topology_devices(args.topology))
  return run(args)
