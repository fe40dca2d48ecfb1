"""The `k3jax` subcommands, one module each, in the order `k3jax --help` lists them.

A command module has `register(subparsers)`, which adds its parser and sets `func(args) ->
int`; it holds flags, defaults and printing, and calls a library module for the work. Third-
party packages outside the core dependencies are imported inside the `run` function that needs
them, so `pip install -e .` alone runs every other command. docs/architecture.md says how to add
one.
"""

from k3jax.commands import (
                            convert,
                            eval,
                            export,
                            generate,
                            info,
                            parity,
                            plan,
                            prepare_data,
                            rl,
                            serve,
                            tokenize,
                            train,
)

COMMANDS = (info, prepare_data, train, rl, generate, serve, eval, convert, export, parity,
            tokenize, plan)

__all__ = ["COMMANDS"]
