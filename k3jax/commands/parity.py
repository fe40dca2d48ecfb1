"""`k3jax parity`: compare a model's logits with a reference file (k3jax/parity.py)."""

from __future__ import annotations

import argparse
import json
import os

from k3jax import parity
from k3jax.errors import UserError
from k3jax.folders import model_folder


def run(args: argparse.Namespace) -> int:
  if not os.path.exists(args.model_dir):
    raise UserError(f"{args.model_dir}: no such folder")
  ref = parity.load_reference(args.reference)
  report = parity.compare(model_folder(args.model_dir).weights, ref, args.dtype,
                          decode=args.decode, save_logits=args.save_logits, mesh=args.mesh)
  report.update(model=args.model_dir, reference=args.reference)  # as the user named them
  if args.json:
    print(json.dumps(report))
  else:
    print(parity.format_report(report))
  return 0 if report["passed"] else 1


def register(sub) -> None:
  p = sub.add_parser("parity", help="compare a model's logits with a PyTorch reference file",
                     description=parity.__doc__.splitlines()[0],
                     epilog="Exit 0 within tolerance, 1 outside it, 2 on bad input.")
  p.add_argument("model_dir", metavar="MODEL_DIR",
                 help="official K3 / Kimi-Linear folder, a converted k3jax checkpoint or a "
                      "`k3jax train` output")
  p.add_argument("--reference", required=True, metavar="NPZ",
                 help=".npz with input_ids and logits (and logits_fp64, layer_out_i)")
  p.add_argument("--dtype", choices=tuple(parity.NUMERICS), default="float32")
  p.add_argument("--mesh", default=None, metavar="MESH",
                 help="run sharded on a device mesh, e.g. data=2,expert=2,tensor=2")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--decode", action="store_true",
                 help="also prefill decode_prefill_len tokens and decode the rest one by one "
                      "through the cache, against decode_logits_fp64")
  p.add_argument("--save-logits", metavar="OUT.npz",
                 help="write the computed logits (and decode logits) to an .npz")
  p.set_defaults(func=run)
