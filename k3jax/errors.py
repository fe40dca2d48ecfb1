"""The errors k3jax raises for bad input: the command line prints them as one line (the message
names the file, flag or field at fault) and exits 2, without a traceback.

Every one derives from `K3jaxError`, which the CLI catches. The floors below `k3jax/`
(`sharding/`, `pallas_kernels/`) raise their own (`sharding.MeshError`, `ValueError`) and the
CLI catches `sharding.MeshError` too.
"""

from __future__ import annotations


class K3jaxError(Exception):
  """Bad input from a user: reported in one line, non-zero exit, no traceback."""


class UserError(K3jaxError):
  """A bad flag, file or value given to a command."""


class ConfigError(K3jaxError, ValueError):
  """A config that k3jax cannot run exactly as the official code would."""


class CheckpointError(UserError, ValueError):
  """A checkpoint folder (or converted checkpoint) is not what its config and index promise.

  The message names the file, tensor or field at fault."""


class ChatError(UserError):
  """A conversation that cannot be rendered / trained on (the message says why)."""
