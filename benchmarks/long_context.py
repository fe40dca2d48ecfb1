"""Prefill time against sequence length: the hybrid (KDA 3:1 MLA) against its all-MLA twin, and
a prefill split over context=4 against one device.

    python benchmarks/long_context.py              # 4K .. 128K positions (docs/benchmarks.md)
    python benchmarks/long_context.py --quick      # 4K .. 16K, a smoke run
    python benchmarks/long_context.py --json       # the same, ending with one JSON line

Two models of the same widths and depth, small enough for a CPU: K3-shaped ([KDA, KDA, KDA,
MLA], AttnRes, a dense first layer, LatentMoE) and its twin with every layer MLA. One prefill
is the model's forward over one sequence of T positions up to the final norm (the head's
[T, vocab] logits are a per-token cost either way), MLA's attention blockwise (`flash`: no
[T, T] scores). The time of each length is the fastest of --reps runs of the compiled forward;
the fitted exponent is the slope of log time against log T over the lengths (least squares):
1 for work linear in T, 2 for attention's pairs. KDA's work is linear, so the hybrid's
exponent stays nearer 1 the longer the sequence, where the all-MLA twin's tends to 2.

Context parallelism: the hybrid's prefill of --context-length positions split over `context=4`
(4 of 8 virtual CPU devices) against the same prefill on one device. The 4 devices share the
CPU's cores, so this is the cost of the split (the maps' composition, the conv halos, MLA's
latent gather, the imbalance of causal attention), not a speed-up; a pod divides the work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs
from k3jax.execution import Execution
from k3jax.model.transformer import K3Model
from sharding.mesh import make_mesh
from sharding.placement import place_model

LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
QUICK = (4096, 8192, 16384)


def hybrid_config():
  return configs.get("tiny").replace(
      vocab_size=512, hidden_size=64, num_layers=4, mla_layers=(3,), kda_num_heads=2,
      kda_head_dim=32, mla_num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
      qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, num_experts=8,
      num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32, latent_size=32,
      attn_res_block_size=2)


def all_mla_config(cfg):
  return cfg.replace(mla_layers=tuple(range(cfg.num_layers)))


EXECUTION = Execution(attention="flash", attention_block=512)


def prefill(cfg, length: int, mesh=None):
  """A compiled forward of one sequence and its input (placed on `mesh`, if any)."""
  model = K3Model(cfg, EXECUTION, rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, length)))
  if mesh is not None:
    place_model(model, mesh)
    ids = jax.device_put(ids, jax.NamedSharding(mesh, jax.P(None, "context")))
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, logits=False).features)
  if mesh is None:
    return fn.lower(state, ids).compile(), (state, ids)
  with jax.set_mesh(mesh):
    return fn.lower(state, ids).compile(), (state, ids)


def fastest(compiled, args, reps: int) -> float:
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def exponent(lengths, seconds) -> float:
  return float(np.polyfit(np.log(lengths), np.log(seconds), 1)[0])


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")),
                 help=f"positions per prefill (default {','.join(map(str, LENGTHS))})")
  p.add_argument("--quick", action="store_true", help=f"lengths {QUICK}")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--context-length", type=int, default=16384,
                 help="positions of the context=4 against one device comparison")
  p.add_argument("--json", action="store_true", help="end with one line of JSON")
  a = p.parse_args(argv)
  lengths = a.lengths or (QUICK if a.quick else LENGTHS)
  cfg = hybrid_config()
  models = {"hybrid": cfg, "all_mla": all_mla_config(cfg)}
  seconds = {name: [] for name in models}
  for length in lengths:
    for name, model_cfg in models.items():
      compiled, args = prefill(model_cfg, length)
      seconds[name].append(fastest(compiled, args, a.reps))
    print(f"T={length:>7}: hybrid {seconds['hybrid'][-1]:8.3f} s, "
          f"all-MLA {seconds['all_mla'][-1]:8.3f} s "
          f"({seconds['all_mla'][-1] / seconds['hybrid'][-1]:.2f}x)", flush=True)
  exps = {name: exponent(lengths, s) for name, s in seconds.items()}
  print(f"fitted exponent (time ~ T^e, {lengths[0]}..{lengths[-1]}): hybrid "
        f"{exps['hybrid']:.2f}, all-MLA {exps['all_mla']:.2f}", flush=True)

  one = fastest(*prefill(cfg, a.context_length), a.reps)
  split = fastest(*prefill(cfg, a.context_length, make_mesh("context=4", jax.devices()[:4])),
                  a.reps)
  print(f"hybrid prefill of {a.context_length}: one device {one:.3f} s, context=4 "
        f"{split:.3f} s on 4 virtual devices sharing the CPU ({split / one:.2f}x: the split's "
        "overhead, not a speed-up)", flush=True)
  if a.json:
    print(json.dumps({
        "lengths": list(lengths), "hybrid_seconds": seconds["hybrid"],
        "all_mla_seconds": seconds["all_mla"], "context_length": a.context_length,
        "one_device_seconds": one, "context4_seconds": split,
        "context4_over_one_device": split / one, "hybrid_exponent": exps["hybrid"],
        "all_mla_exponent": exps["all_mla"]}))


if __name__ == "__main__":
  main()
