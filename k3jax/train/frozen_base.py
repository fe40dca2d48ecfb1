"""The frozen base of a fine-tuning run, kept out of its checkpoints
(docs/training.md#checkpoints-and-outputs).

Under LoRA (and under `--base-experts mxfp4`, whose packed experts are never trained) part of
the params never changes: the frozen base, at K3 size nearly all of the bytes. A checkpoint
then holds the trainable leaves only (with their optimizer state, router biases, step, RNG
and data position) plus a small JSON reference:

    {"folder": the base's weights folder (absolute) or null: a base initialised from "seed",
     "seed": the run's seed,
     "fingerprint": convert.fingerprint of the folder (null without one),
     "bytes": the base files' size}

A resume recomputes the fingerprint, refuses a base that differs or is gone (one line naming
the folder and what differs), rebuilds the frozen leaves exactly as the run first did (load,
adapt: MXFP4 packing included) and puts the restored trainable leaves back among them.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from convert import fingerprint as fp_lib
from k3jax.errors import UserError
from k3jax.run.params import combine, partition


def has_frozen(mask: Any) -> bool:
  """Whether some params leaf is not trained (the mask of step.Steps.trainable)."""
  return not all(jax.tree.leaves(mask))


def reference(folder: str | None, seed: int) -> dict:
  """The reference a checkpoint keeps for the base in `folder` (None: initialised from
  `seed`)."""
  if folder is None:
    return {"folder": None, "seed": seed, "fingerprint": None, "bytes": None}
  fp = fp_lib.fingerprint(folder)
  return {"folder": folder, "seed": seed, "fingerprint": fp, "bytes": fp_lib.total_bytes(fp)}


def check(ref: dict, where: str) -> None:
  """Refuse to resume over a base that is not the one `ref` records (`where`: the
  checkpoint, for the message)."""
  folder = ref.get("folder")
  if folder is None:
    return
  if not os.path.isdir(folder):
    raise UserError(f"{folder}: the base folder {where} refers to is missing; put it back to "
                    "resume, or use a new --out")
  diffs = fp_lib.differences(ref["fingerprint"], fp_lib.fingerprint(folder))
  if diffs:
    more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    raise UserError(f"{folder}: not the base {where} was trained on ({'; '.join(diffs[:3])}"
                    f"{more}); resume needs that base, or use a new --out")


def trainable_state(state: dict, mask: Any) -> dict:
  """A TrainState (or its abstract / sharding tree) with the frozen params left out: what a
  checkpoint of a run with a frozen base holds."""
  return {**state, "params": partition(state["params"], mask)[0]}


def with_base(state: dict, base_params: Any, mask: Any) -> dict:
  """A restored trainable-only TrainState completed with the frozen leaves of `base_params`
  (the run's initial params, rebuilt)."""
  return {**state, "params": combine(state["params"], partition(base_params, mask)[1])}

