"""`k3jax info`: parameter counts and inference-state sizes of a config (k3jax/info.py)."""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

import configs
from k3jax import info
from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.transformer import K3Model


def run(args: argparse.Namespace) -> int:
  cfg = configs.resolve(args.config)
  ex = Execution(dtype=args.dtype) if args.dtype else Execution()  # refuses an unknown dtype
  s = info.summary(cfg, args.dtype or "bfloat16")
  if args.json:
    print(json.dumps({"config": args.config, **s}, indent=None))
  else:
    print(info.format_summary(args.config, s))
  if args.forward:
    print(_tiny_forward(cfg, ex))
  return 0


def _tiny_forward(cfg: ModelConfig, ex: Execution) -> str:
  """Run the model once on a few random tokens: a smoke test that the config builds and runs."""
  t0 = time.perf_counter()
  model = K3Model(cfg, ex, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.vocab_size)
  logits = nnx.jit(lambda m, x: m(x).logits)(model, ids)
  ok = bool(jnp.isfinite(logits).all())
  return (f"forward pass: ids [1, 16] -> logits {tuple(logits.shape)} {logits.dtype}, "
          f"finite={ok}, {time.perf_counter() - t0:.1f}s")


def register(sub) -> None:
  p = sub.add_parser("info", help="parameter counts and state sizes of a config",
                     description=info.__doc__.splitlines()[0])
  p.add_argument("--config", required=True,
                 help="preset (k3, kimi_linear_48b, tiny), an HF config.json or model folder")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--dtype", help="cache dtype for the byte counts (default: bfloat16, as K3 "
                 "serves), and the compute dtype of --forward (default: float32)")
  p.add_argument("--forward", action="store_true",
                 help="also build the model and run one forward pass on 16 random tokens")
  p.set_defaults(func=run)
