"""The folder a user names as a model, and what it holds: where the weights, their config and
their tokenizer are.

Every command that takes a model folder (`generate`, `parity`, `export`, `tokenize`,
`info --config`, `train --init-from`) resolves it here, so each takes the same three kinds:

    an official-layout folder    config.json + safetensors (+ tiktoken.model, ...)
    a k3jax checkpoint           k3jax_config.json + Orbax (`k3jax convert`, a run's model/)
    a `k3jax train` output       run.json + model/: the weights in model/, the tokenizer the
                                 run trained with (its --tokenizer, from its --init-from)

Paths come back absolute (Orbax refuses relative ones, and a run records its --init-from for
later commands that may run elsewhere); a relative one is taken from the working directory.
"""

from __future__ import annotations

import dataclasses
import json
import os

from k3jax.errors import UserError

RUN_FILE = "run.json"  # a `k3jax train` output's options and model config
MODEL_DIR = "model"    # ... and its final weights, a k3jax checkpoint
TOKENIZER_KINDS = ("auto", "byte", "tiktoken")  # else a folder: that folder's tokenizer


@dataclasses.dataclass(frozen=True)
class TokenizerSource:
  """What `k3jax.tokenizer.load_tokenizer(kind, folder)` takes: `kind` auto | byte | tiktoken
  or a folder (absolute); `folder` (absolute, or None) holds the tokenizer files and the chat
  template (tokenizer_config.json)."""
  kind: str
  folder: str | None


@dataclasses.dataclass(frozen=True)
class ModelFolder:
  weights: str                 # absolute: an official-layout folder or a k3jax checkpoint
  tokenizer: TokenizerSource
  run: str | None = None       # absolute: the `k3jax train` output the weights come from


def is_run(path: str) -> bool:
  """A `k3jax train` output folder with its final weights."""
  return (os.path.isfile(os.path.join(path, RUN_FILE))
          and os.path.isdir(os.path.join(path, MODEL_DIR)))


def model_folder(path: str) -> ModelFolder:
  """The model at `path` (see the module docstring). A path that does not exist comes back
  as itself, made absolute: the caller refuses it in its own words."""
  return _model_folder(os.path.abspath(path), ())


def tokenizer_source(kind: str, init_from: str | None) -> TokenizerSource:
  """The tokenizer `k3jax train --tokenizer KIND [--init-from INIT]` trains with: auto takes
  the init model's own (its folder's tiktoken.model, or what its run trained with), byte and
  tiktoken as named, a folder that folder's (a run folder: the run's)."""
  return _tokenizer_source(kind, init_from, ())


def absolute(path: str | None) -> str | None:
  """A path-valued option (--init-from, --data) as a run records it: absolute."""
  return None if path is None else os.path.abspath(path)


def absolute_tokenizer(kind: str) -> str:
  """--tokenizer as a run records it: a kind as it is, a folder absolute."""
  return kind if kind in TOKENIZER_KINDS else os.path.abspath(kind)


def _model_folder(path: str, seen: tuple[str, ...]) -> ModelFolder:
  # A run's --init-from that leads back to a run folder met on the way (`--init-from X
  # --out X`) names that folder's own files: the weights and tokenizer it held before
  if not is_run(path) or path in seen:
    return ModelFolder(path, TokenizerSource("auto", path))
  run_file = os.path.join(path, RUN_FILE)
  try:
    with open(run_file) as f:
      options = json.load(f).get("options", {})
  except (OSError, json.JSONDecodeError, AttributeError) as e:
    raise UserError(f"{run_file}: unreadable run file ({e})") from None
  source = _tokenizer_source(options.get("tokenizer") or "auto", options.get("init_from"),
                             (*seen, path))
  return ModelFolder(os.path.join(path, MODEL_DIR), source, run=path)


def _tokenizer_source(kind: str, init_from: str | None, seen: tuple[str, ...]
                      ) -> TokenizerSource:
  init = _model_folder(os.path.abspath(init_from), seen) if init_from else None
  if kind == "auto":
    return init.tokenizer if init else TokenizerSource("auto", None)
  if kind == "byte":
    return TokenizerSource("byte", None)
  if kind == "tiktoken":
    return TokenizerSource("tiktoken", init.tokenizer.folder if init else None)
  folder = _model_folder(os.path.abspath(kind), seen)
  if folder.run is not None:
    return folder.tokenizer
  return TokenizerSource(folder.weights, folder.weights)


LENGTH_KEYS = ("max_position_embeddings", "model_max_length")


def max_model_len(folder: ModelFolder) -> int | None:
  """The longest sequence the model's own files declare (`max_position_embeddings` in its
  config.json, top level or text_config; `model_max_length` in its tokenizer_config.json), or
  None. A `k3jax train` run's training sequence length is not one: it says what was trained
  on, not what the model can read."""
  dirs = [folder.weights, os.path.join(folder.weights, "hf")]
  if folder.tokenizer.folder:
    dirs.append(folder.tokenizer.folder)
  for d in dirs:
    for name in ("config.json", "tokenizer_config.json"):
      try:
        with open(os.path.join(d, name)) as f:
          raw = json.load(f)
      except (OSError, ValueError):
        continue
      if not isinstance(raw, dict):
        continue
      for section in (raw, raw.get("text_config") or {}):
        for key in LENGTH_KEYS:
          value = section.get(key) if isinstance(section, dict) else None
          # HF writes a huge sentinel (1e30) for "no limit" in model_max_length
          if isinstance(value, int) and 0 < value < 10**9:
            return value
  return None
