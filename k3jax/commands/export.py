"""`k3jax export`: a k3jax checkpoint -> the official safetensors layout."""

from __future__ import annotations

import argparse

from convert.lora_export import export_adapters
from convert.to_hf import export
from k3jax.commands._args import io_errors_are_user_errors
from k3jax.errors import CheckpointError
from k3jax.folders import model_folder


@io_errors_are_user_errors
def run(args: argparse.Namespace) -> int:
  if args.merge_lora and args.adapter_only:
    raise CheckpointError("--merge-lora and --adapter-only are exclusive")
  ckpt_dir = model_folder(args.ckpt_dir).weights  # a `k3jax train` output: its model/
  if args.adapter_only:
    summary = export_adapters(ckpt_dir, args.out_dir, force=args.force)
    print(f"wrote {args.out_dir}: {summary['tensors']} adapter tensors, "
          f"{summary['params']:,} parameters")
    return 0
  summary = export(ckpt_dir, args.out_dir, force=args.force, progress=not args.quiet,
                   num_shards=args.num_shards, merge_lora=args.merge_lora)
  print(f"wrote {args.out_dir}: {len(summary['files'])} shard(s), "
        f"{summary['total_size']:,} bytes of tensors ({summary['dialect']} layout)")
  return 0


def register(sub) -> None:
  p = sub.add_parser(
      "export", help="k3jax Orbax checkpoint -> official safetensors folder",
      description="Write a k3jax checkpoint back in the official layout: same names, dtypes "
      "and shards as the folder it came from (or the official K3 layout for a checkpoint "
      "trained in k3jax), routed experts as MXFP4.")
  p.add_argument("ckpt_dir", metavar="CKPT_DIR")
  p.add_argument("out_dir", metavar="OUT_DIR")
  p.add_argument("--merge-lora", action="store_true",
                 help="a `k3jax train --lora` model: adapters merged into the weights "
                 "(W + alpha/r A B), routed experts re-quantised to MXFP4")
  p.add_argument("--adapter-only", action="store_true",
                 help="a `k3jax train --lora` model: only the adapters, as "
                 "adapter_model.safetensors + adapter_config.json")
  p.add_argument("--num-shards", type=int, default=None,
                 help="shard count for a fresh layout (default: the source's, or 5 GiB each)")
  p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  p.set_defaults(func=run)
