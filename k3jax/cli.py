"""`k3jax` command line: info | train | rl | generate | serve | eval | convert | export |
parity | tokenize | plan.

Each subcommand is a module of `k3jax/commands/` (registered in `k3jax.commands.COMMANDS`).
Bad input raises `k3jax.errors.K3jaxError` (or `sharding.MeshError` from the mesh floor): it
is printed as one line, exit code 2, without a traceback. A mismatched JAX family
(k3jax/jax_family.py) is said in one line after the command's own output, never above its error;
jaxlib's own warning about it is silenced.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from k3jax import jax_family
from k3jax.commands import COMMANDS
from k3jax.errors import K3jaxError
from sharding import MeshError


def build_parser() -> argparse.ArgumentParser:
  summary = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, one line
  parser = argparse.ArgumentParser(prog="k3jax", description=summary)
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for command in COMMANDS:
    command.register(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  warnings.filterwarnings("ignore", message=jax_family.PLUGIN_WARNING, category=RuntimeWarning)
  try:
    return _run(args)
  finally:
    if (line := jax_family.mismatch_line()) is not None:
      print(f"k3jax {args.command}: warning: {line}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
  try:
    return int(args.func(args) or 0)
  except (K3jaxError, MeshError) as e:
    print(f"k3jax {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"k3jax {args.command}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
