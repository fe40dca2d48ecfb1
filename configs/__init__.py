"""Built-in model presets: `get(name)` returns a ModelConfig for "k3", "kimi_linear_48b", "tiny".

A preset is a Python module here with a `config()` function. `resolve(name_or_path)` also
accepts an HF config.json (or a model folder, k3jax.folders) or a k3jax config JSON.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from k3jax.config import ModelConfig
from k3jax.errors import ConfigError
from k3jax.folders import model_folder
from k3jax.hf_config import from_hf_config

PRESETS = ("k3", "kimi_linear_48b", "tiny")


def get(name: str, **overrides: Any) -> ModelConfig:
  if name not in PRESETS:
    raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
  cfg = importlib.import_module(f"configs.{name}").config()
  return cfg.replace(**overrides) if overrides else cfg


def resolve(name_or_path: str, **overrides: Any) -> ModelConfig:
  """A preset name, an HF config.json / model folder (a `k3jax train` output: its model/), or
  a k3jax config JSON."""
  if name_or_path in PRESETS:
    return get(name_or_path, **overrides)
  path = name_or_path
  if os.path.isdir(path):
    path = model_folder(path).weights
    k3jax_json = os.path.join(path, "k3jax_config.json")
    path = k3jax_json if os.path.exists(k3jax_json) else os.path.join(path, "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                      "nor a config file")
  try:
    with open(path) as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: not valid JSON ({e})") from None
  if isinstance(raw, dict) and raw.get("format") == "k3jax":
    cfg = ModelConfig.from_dict(raw["config"])
    return cfg.replace(**overrides) if overrides else cfg
  return from_hf_config(raw, **overrides)
