"""`k3jax` command line: info | convert | export | parity | train | generate | tokenize | plan
(SPEC §9).

Each subcommand lives in its own module exposing `register(subparsers)`; the parser it adds
sets `func(args) -> int`. User mistakes raise `UserError` (or ConfigError) and are printed as
one line, exit code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from k3jax.config import ConfigError


class UserError(Exception):
  """Bad input from the user: printed as one line, non-zero exit, no traceback."""


# Every subcommand that runs; `--help` lists exactly these (tests/k3jax/test_cli.py checks them
# against the README's command list).
_SUBCOMMANDS = (
    "k3jax.info",
    "k3jax.train.cli",
    "k3jax.generate",
    "convert.cli",
    "k3jax.parity",
    "k3jax.tokenize_cli",
    "k3jax.plan_cli",
)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="k3jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for name in _SUBCOMMANDS:
    importlib.import_module(name).register(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return int(args.func(args) or 0)
  except (UserError, ConfigError) as e:
    print(f"k3jax {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"k3jax {args.command}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  # `python -m k3jax.cli`: run the imported module's main, so that the UserError subcommands
  # raise (k3jax.cli.UserError) is the one caught, not this __main__ copy's
  from k3jax.cli import main as _main  # noqa: PLC0415
  sys.exit(_main())
