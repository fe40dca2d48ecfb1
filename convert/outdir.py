"""Output folders that appear whole or not at all.

Everything is written into a hidden temporary folder beside OUT_DIR and renamed into place at
the end (a rename within one file system is atomic); on any error, or Ctrl-C, the temporary
folder is removed, so no half-written checkpoint is ever left where a user would look.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from convert.errors import CheckpointError


@contextlib.contextmanager
def staged(out_dir: str, *, force: bool, inputs: tuple[str, ...] = ()) -> Iterator[str]:
  """Yields a temporary folder; on success it becomes `out_dir` (replacing it if `force`)."""
  out_dir = os.path.abspath(out_dir)
  real_out = os.path.realpath(out_dir)
  for src in inputs:
    real_src = os.path.realpath(src)
    if real_out == real_src or real_src.startswith(real_out + os.sep):
      raise CheckpointError(f"{out_dir}: the output folder would replace the input {src}")
  if os.path.lexists(out_dir) and not force:
    raise CheckpointError(f"{out_dir} already exists (pass --force to replace it)")
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become OUT_DIR's mode
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.lexists(out_dir):
    old = tmp + ".old"
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.rename(tmp, out_dir)
