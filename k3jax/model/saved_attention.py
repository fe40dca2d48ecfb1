"""MLA's attention output kept through remat (`Remat.SAVE_ATTENTION`: docs/kernels.md#keeping-
the-attention-through-remat).

Full remat recomputes each layer's forward in the backward, the attention's loops included; at
a million positions those loops are most of the forward. The flash kernels can return their
(o, row max, lse) (`with_lse=True`) and later run the backward from that triple with no
forward loop (`saved=`). How a recomputed layer gets the triple its forward made depends on how
the layer is recomputed:

- under `jax.checkpoint` (nnx.remat of a layer), the triple carries the checkpoint name `KEPT`,
  and the save-attention policy saves exactly the values of that name;
- under `block_scan` (the full-remat scan of models with Block AttnRes), the forward records
  each layer's triples on a tape (`recording`) and returns them as scan outputs; the backward
  replays them (`replaying`), in the order the layer made them, into its recompute.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.ad_checkpoint import checkpoint_name

KEPT = "attention_kept"
_TAPE: contextvars.ContextVar[_Tape | None] = contextvars.ContextVar("attention_tape",
                                                                    default=None)


class _Tape:
  def __init__(self, items=None):
    self.recording = items is None
    self.items = [] if items is None else list(items)


@contextlib.contextmanager
def recording():
  """Within it every `attend` records its (o, row max, lse); yields the list they go to."""
  tape = _Tape()
  token = _TAPE.set(tape)
  try:
    yield tape.items
  finally:
    _TAPE.reset(token)


@contextlib.contextmanager
def replaying(items):
  """Within it each `attend` runs its backward from the next of `items` (a recording of the
  same layer, in order)."""
  tape = _Tape(items)
  token = _TAPE.set(tape)
  try:
    yield
  finally:
    _TAPE.reset(token)
  if tape.items:
    raise RuntimeError(f"{len(tape.items)} kept attention outputs were not replayed: the "
                       "recomputed layer is not the one that recorded them")


def attend(run):
  """(o, row max) of `run`, a flash kernel call taking `with_lse` and `saved`, kept for the
  backward as the module docstring says."""
  tape = _TAPE.get()
  if tape is None:
    # not differentiated here: the saved call's backward is the attention's whole backward
    kept = tuple(checkpoint_name(jax.lax.stop_gradient(x), KEPT) for x in run(with_lse=True))
    return run(saved=kept)
  if tape.recording:
    kept = run(with_lse=True)
    tape.items.append(kept)
    return kept[:2]
  if not tape.items:
    raise RuntimeError("a recomputed layer attends more often than its forward recorded")
  return run(saved=tape.items.pop(0))
