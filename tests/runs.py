"""A `k3jax train` output folder made without training: what commands that take a model folder
see of one (k3jax/folders.py)."""

import json
import os
import shutil

from k3jax.folders import MODEL_DIR, RUN_FILE


def fake_run(path, model: str | None = None, **options) -> str:
  """`path`/run.json holding `options` (tokenizer, init_from, ...), and `path`/model: a copy of
  the checkpoint folder `model` (or an empty folder)."""
  os.makedirs(path, exist_ok=True)
  if model is None:
    os.makedirs(os.path.join(path, MODEL_DIR))
  else:
    shutil.copytree(model, os.path.join(path, MODEL_DIR))
  with open(os.path.join(path, RUN_FILE), "w") as f:
    json.dump({"options": {"tokenizer": "auto", "init_from": None, **options}}, f)
  return str(path)
