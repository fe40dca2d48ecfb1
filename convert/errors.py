"""The one error type of the converter: bad input, reported as one line by the CLI."""

from k3jax.cli import UserError


class CheckpointError(UserError, ValueError):
  """A checkpoint folder (or converted checkpoint) is not what its config and index promise.

  The message names the file, tensor or field at fault; the CLI prints it as one line and
  exits non-zero without a traceback.
  """
