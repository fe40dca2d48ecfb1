"""Output folders that appear whole or not at all.

Everything is written into a hidden temporary folder beside OUT_DIR and renamed into place at
the end (a rename within one file system is atomic), so no half-written output is ever where a
user would look. `staged` (export) removes the folder on any error or Ctrl-C; `resumable`
(convert) keeps it across an interruption for `--resume`, under one name per OUT_DIR, locked
while a process writes it and tied to what is being converted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

from k3jax.errors import CheckpointError, UserError


@contextlib.contextmanager
def staged(out_dir: str, *, force: bool, inputs: tuple[str, ...] = ()) -> Iterator[str]:
  """Yields a temporary folder; on success it becomes `out_dir` (replacing it if `force`)."""
  out_dir = os.path.abspath(out_dir)
  _check_inputs(out_dir, inputs)
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
  _commit(tmp, out_dir)


def _check_inputs(out_dir: str, inputs: tuple[str, ...]) -> None:
  real_out = os.path.realpath(out_dir)
  for src in inputs:
    real_src = os.path.realpath(src)
    if real_out == real_src or real_src.startswith(real_out + os.sep):
      raise CheckpointError(f"{out_dir}: the output folder would replace the input {src}")


def _commit(tmp: str, out_dir: str) -> None:
  """Rename the finished `tmp` into place (an older `out_dir` goes only once it has)."""
  if os.path.lexists(out_dir):
    old = tmp + ".old"
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.rename(tmp, out_dir)


PARTIAL = ".partial"
RESUME_KEY = "k3jax_resume.json"
LOCK = "k3jax_convert.lock"


def partial_dir(out_dir: str) -> str:
  """Where an interrupted conversion of `out_dir` is kept: hidden, beside it, one name."""
  out_dir = os.path.abspath(out_dir)
  return os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}{PARTIAL}")


def _lock(folder: str, out_dir: str):
  """An exclusive lock on `folder` for this process (released when the file is closed)."""
  f = open(os.path.join(folder, LOCK), "a")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.close()
    raise CheckpointError(f"{out_dir}: another conversion is writing it ({folder})") from None
  return f


def _alone(_name: str):
  return contextlib.nullcontext()


@contextlib.contextmanager
def resumable(out_dir: str, *, force: bool, resume: bool, key: dict,
              inputs: tuple[str, ...] = (), main: bool = True,
              together: Callable[[str], contextlib.AbstractContextManager] = _alone
              ) -> Iterator[str]:
  """Like `staged`, but the folder is `partial_dir(out_dir)` and survives an interruption
  (Ctrl-C, a kill, a full disk) so that `resume=True` continues it. It is tied to `key` (what
  is being converted, and how): a resume with another key is refused, never mixed. Bad input
  (a UserError) still removes it: nothing half-written is left of a conversion that cannot
  succeed. The folder is renamed to `out_dir` only when the body returns.

  Several processes writing one folder (a shared file system): each enters with the same
  arguments, `main` true on one of them, and `together(step)` a context manager that runs a
  step on every process and fails on all if it fails on one (sharding.distributed.together).
  Every process checks the folders; then the main process alone replaces, creates, locks and
  keys the folder; on exit it alone renames it (the caller makes the others' bodies end
  first). Bad input keeps the folder there: another process may still be writing it."""
  out_dir = os.path.abspath(out_dir)
  tmp = partial_dir(out_dir)
  key_path = os.path.join(tmp, RESUME_KEY)
  with together("convert_checked"):
    _check_inputs(out_dir, inputs)
    if os.path.lexists(out_dir) and not force:
      raise CheckpointError(f"{out_dir} already exists (pass --force to replace it)")
    if os.path.isdir(tmp) and not os.path.islink(tmp):
      if main:
        _lock(tmp, out_dir).close()  # refuses if another conversion is writing it
      if not force and not resume:
        raise CheckpointError(f"{out_dir}: an interrupted conversion is kept in {tmp}: pass "
                              "--resume to continue it, or --force to start over")
    elif os.path.lexists(tmp):
      raise CheckpointError(f"{tmp} is in the way (not a folder): remove it")
  lock = None
  try:
    with together("convert_prepared"):
      if main:
        lock = _prepare(tmp, out_dir, key, key_path, force)
    try:
      yield tmp
    except UserError:
      if together is _alone:
        shutil.rmtree(tmp, ignore_errors=True)
      raise
    if main:
      os.remove(key_path)
      os.remove(os.path.join(tmp, LOCK))
      _commit(tmp, out_dir)
  finally:
    if lock is not None:
      lock.close()


def _prepare(tmp: str, out_dir: str, key: dict, key_path: str, force: bool):
  """Replace (--force) or reuse (--resume) the partial folder, lock it, and check or write
  its key; returns the lock."""
  if force and os.path.isdir(tmp) and not os.path.islink(tmp):
    _lock(tmp, out_dir).close()  # refuses if another conversion is writing it
    shutil.rmtree(tmp)
  os.makedirs(tmp, exist_ok=True)
  lock = _lock(tmp, out_dir)
  try:
    if os.path.exists(key_path):
      with open(key_path) as f:
        try:
          old = json.load(f)
        except json.JSONDecodeError:
          old = None
      if old != key:
        raise CheckpointError(f"{out_dir}: the interrupted conversion in {tmp} was started "
                              "from other inputs or options: pass --force to start over")
    else:
      with open(key_path + ".tmp", "w") as f:
        json.dump(key, f)
        f.flush()
        os.fsync(f.fileno())
      os.rename(key_path + ".tmp", key_path)
  except BaseException:
    lock.close()
    raise
  return lock
