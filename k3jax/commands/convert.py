"""`k3jax convert`: the official safetensors folder -> a k3jax Orbax checkpoint.

Several processes (hosts) share the work: start the same command on each with
--coordinator HOST:PORT --num-processes N --process-id I (on Cloud TPU the environment provides
them: nothing to add, or --coordinator auto), OUT_DIR on a file system they all see. The
tensors, in source-file order, are cut into N runs of about equal bytes; each process reads
only its run and writes it into its own database of the one Orbax checkpoint
(ocdbt.process_I); once every process has committed, process 0 merges them, writes the
metadata and side files, and renames the folder into place. --resume continues each process
from its own journal (the same N); a process that fails stops the others with its error.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

from convert.outdir import partial_dir
from convert.to_orbax import convert
from k3jax.commands._args import Formatter, add_processes
from k3jax.errors import CheckpointError
from sharding import distributed


def _fixed_mmap_threshold() -> None:
  """glibc raises its mmap threshold whenever a big buffer is freed (up to 32 MiB); tensors
  of a few MiB then come from the heap arenas of TensorStore's threads and stay there after
  they are freed (docs/benchmarks.md#conversion). A fixed 1 MiB threshold hands
  every tensor's memory back to the OS when it is freed."""
  try:
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # -3: M_MMAP_THRESHOLD
  except (OSError, AttributeError):  # not glibc: its allocator, its behaviour
    pass


def _convert(args: argparse.Namespace) -> int:
  """An interruption or an I/O error keeps the part written so far: say how to continue."""
  _fixed_mmap_threshold()
  try:
    return _convert_or_raise(args)
  except (OSError, KeyboardInterrupt) as e:
    kept = partial_dir(args.out_dir)
    resume = (f"; the part written so far is kept in {kept}: the same command with --resume "
              "continues") if os.path.isdir(kept) else ""
    if isinstance(e, KeyboardInterrupt):
      print(f"k3jax convert: interrupted{resume}", file=sys.stderr)
      return 130
    where = f"{e.filename}: " if e.filename else ""
    raise CheckpointError(f"{where}{e.strerror or e}{resume}") from None


def _convert_or_raise(args: argparse.Namespace) -> int:
  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  manifest = convert(args.hf_dir, args.out_dir, layers=args.layers, experts=args.experts,
                     force=args.force, resume=args.resume, progress=not args.quiet)
  if manifest["processes"] > 1:  # each process: its share (the test counts the bytes read)
    print(f"process {manifest['process']}/{manifest['processes']}: {manifest['tensors']} "
          f"tensors, {manifest['bytes_read']} bytes read")
    if manifest["process"] != 0:
      return 0
  held = "all layers" if manifest["layers"] is None else "layers {}-{}".format(*manifest["layers"])
  resumed = f"; {manifest['resumed']} tensors were already written" if manifest["resumed"] else ""
  print(f"wrote {args.out_dir} ({manifest['dialect']} layout, {held}, experts "
        f"{manifest['experts']}{resumed})")
  return 0


def register(sub) -> None:
  p = sub.add_parser(
      "convert", help="official safetensors folder -> k3jax Orbax checkpoint",
      formatter_class=Formatter, epilog=__doc__.split("\n", 2)[2],
      description="Convert an official K3 or Kimi-Linear folder (config.json, safetensors "
      "shards and index) into an Orbax checkpoint of the k3jax parameter tree, streaming one "
      "tensor at a time. Vision tensors are skipped unread. The work happens in "
      ".OUT_DIR.partial beside OUT_DIR, renamed into place only when complete; an "
      "interrupted conversion (Ctrl-C, a kill, a full disk) stays there for --resume.")
  p.add_argument("hf_dir", metavar="HF_DIR")
  p.add_argument("out_dir", metavar="OUT_DIR")
  p.add_argument("--layers", metavar="A-B",
                 help="convert only layers A..B (inclusive); the checkpoint records it. A "
                 "prefix 0-B can be checked with `k3jax parity` layer by layer")
  p.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16",
                 help="routed experts dequantised to bf16 (default), or kept as MXFP4 codes "
                 "and scales (dequantised at load; export is then byte-identical)")
  p.add_argument("--force", action="store_true",
                 help="replace OUT_DIR if it exists, and discard an interrupted conversion")
  p.add_argument("--resume", action="store_true",
                 help="continue the interrupted conversion of OUT_DIR (same inputs and "
                 "options; starts afresh if there is none)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  add_processes(p, what="each converts about 1/N of the tensor bytes")
  p.set_defaults(func=_convert)
