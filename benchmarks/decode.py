"""Decode speed: per-token latency against context length, hybrid (KDA 3:1 MLA) vs all-MLA.

    python benchmarks/decode.py                         # contexts 1K..32K, batch 1 (~6 min)
    python benchmarks/decode.py --batch 4 --contexts 32768
    python benchmarks/decode.py --quick                 # contexts 1K and 4K, a smoke run

Two models of the same widths: a K3-shaped small model ([KDA, KDA, KDA, MLA] x 3, AttnRes
blocks, dense first layer, LatentMoE; K3's per-head sizes: KDA d_k = d_v = 128, MLA latent
512 + rope 64, nope 128, v 128) and its all-MLA twin (every layer MLA). One decode step is the
real `extend` of one token per row (fused KDA step, MLA over the latent cache with k_b / v_b
absorbed, the cache donated), timed at each context length on a cache filled with random
latents and states (a decode step's cost does not depend on the values; prefilling 32K tokens
on a CPU would take most of an hour). Prefill tokens/s: a real prefill of --prefill tokens in
chunks of 512 from an empty cache.

Goals (CPU): the hybrid decodes >= 3x faster than the twin at 32K (KDA's state does not grow
with context, MLA's cache does), and the hybrid's decode step at the shortest context is
within 2x of the matmul-bound time of reading the active weights once (the weights a decode
step needs: every matrix except the embedding table, of which one row is read, and only the k
selected routed experts; measured as one [batch, n] @ [n, m] matmul of that many fp32 weights).
The machine may be shared: the two models' steps are timed alternately (each sees the same
load), and each number is the fastest of --reps (the least disturbed run); medians are printed
beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def hybrid_config():
  import configs
  return configs.get("tiny").replace(
      vocab_size=8192, hidden_size=512, num_layers=12, mla_layers=(3, 7, 11),
      kda_num_heads=8, kda_head_dim=128, mla_num_heads=8, q_lora_rank=384, kv_lora_rank=512,
      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=1536,
      num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=256,
      latent_size=256, attn_res_block_size=4)


def twin_config(cfg):
  return cfg.replace(mla_layers=tuple(range(cfg.num_layers)))


def random_model(cfg, seed=0):
  """The model (float32) with small random weights, built without running the initialisers."""
  from k3jax.model.transformer import K3Model
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for _, var in nnx.to_flat_state(nnx.state(model)):
    fan = var.shape[-2] if len(var.shape) >= 2 else 1
    var.set_value(jnp.asarray(rng.standard_normal(var.shape) / np.sqrt(fan), var.dtype))
  return model


def active_weight_params(cfg) -> int:
  """Weights one decode step reads: all parameters but the embedding table (one row of it)
  and the routed experts a token does not use."""
  from k3jax.info import summary
  return summary(cfg)["active_params"] - cfg.vocab_size * cfg.hidden_size


def timed(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def interleaved(fns: dict, reps: int) -> dict[str, tuple[float, float]]:
  """name -> (fastest, median) seconds of fns[name](), the functions run in turn."""
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      times[name].append(timed(fn))
  return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def matmul_bound(n_params: int, batch: int, reps: int) -> float:
  """Seconds of one [batch, 1024] @ [1024, n/1024] fp32 matmul: reading n weights once."""
  w = jnp.asarray(np.random.default_rng(0).standard_normal((1024, n_params // 1024)),
                  jnp.float32)
  x = jnp.ones((batch, 1024), jnp.float32)
  f = jax.jit(lambda x, w: x @ w)
  jax.block_until_ready(f(x, w))
  return interleaved({"matmul": lambda: f(x, w)}, reps)["matmul"][0]


def filled_cache(gen, batch: int, context: int, seed: int = 0):
  """A cache holding `context` positions of random latents and states (room for 64 more)."""
  from k3jax.generate.static_batch import cache_len
  cache = gen.new_cache(batch, cache_len(context + 64))
  leaves, treedef = jax.tree.flatten((cache.kda, cache.mla))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [(0.1 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
            for k, a in zip(keys, leaves)]
  kda, mla = jax.tree.unflatten(treedef, leaves)
  return cache._replace(kda=kda, mla=mla, length=jnp.int32(context))


def decode_step(gen, batch: int, context: int):
  """A compiled decode step at `context` (every call does the same work)."""
  box = {"cache": filled_cache(gen, batch, context)}
  tok = jnp.zeros((batch, 1), jnp.int32)

  def step():
    logits, box["cache"] = gen.extend(tok, box["cache"]._replace(length=jnp.int32(context)))
    return logits

  jax.block_until_ready(step())  # compile
  return step


def prefill_run(gen, cfg, batch: int, tokens: int):
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, tokens)).astype(np.int32)
  start = np.zeros(batch, np.int32)
  run = lambda: gen.prefill(ids, start, gen.max_len(tokens, 1))[0]
  jax.block_until_ready(run())  # compile
  return run


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384,
                                                              32768])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--prefill", type=int, default=2048, help="prompt tokens for prefill tokens/s")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--quick", action="store_true", help="contexts 1K and 4K, 3 reps")
  args = p.parse_args(argv)
  if args.quick:
    args.contexts, args.reps, args.prefill = [1024, 4096], 3, 1024

  from k3jax.generate.static_batch import StaticBatch
  from k3jax.info import summary
  cfgs = {"hybrid": hybrid_config()}
  cfgs["all-MLA"] = twin_config(cfgs["hybrid"])
  gens = {name: StaticBatch(random_model(cfg), prefill_chunk=512) for name, cfg in cfgs.items()}
  print(f"platform {jax.default_backend()}, {os.cpu_count()} CPUs; batch {args.batch}, float32")
  for name, cfg in cfgs.items():
    s = summary(cfg, "float32")
    print(f"{name}: {cfg.num_layers} layers ({s['layers']['kda']} KDA + {s['layers']['mla']} "
          f"MLA), d={cfg.hidden_size}, {s['total_params'] / 1e6:.1f}M params, "
          f"{active_weight_params(cfg) / 1e6:.1f}M read per decode step; cache per row "
          f"{s['kda_state_bytes_per_request'] / 2**20:.1f} MiB + "
          f"{s['mla_cache_bytes_per_token']} B/token")

  bound = matmul_bound(active_weight_params(cfgs["hybrid"]), args.batch, args.reps)
  print(f"matmul-bound time of the hybrid's active weights: {1e3 * bound:.2f} ms "
        f"({4 * active_weight_params(cfgs['hybrid']) / bound / 1e9:.1f} GB/s)")
  print(f"{'context':>8} {'hybrid ms':>10} {'all-MLA ms':>11} {'all-MLA / hybrid':>17}"
        f"   (medians: hybrid, all-MLA)")
  results = {}
  for ctx in args.contexts:
    steps = {name: decode_step(gens[name], args.batch, ctx) for name in cfgs}
    t = interleaved(steps, args.reps)
    del steps
    results[ctx] = {name: v[0] for name, v in t.items()}
    print(f"{ctx:>8} {1e3 * t['hybrid'][0]:>10.2f} {1e3 * t['all-MLA'][0]:>11.2f} "
          f"{t['all-MLA'][0] / t['hybrid'][0]:>16.2f}x   ({1e3 * t['hybrid'][1]:.2f}, "
          f"{1e3 * t['all-MLA'][1]:.2f})", flush=True)
  runs = {name: prefill_run(gens[name], cfgs[name], args.batch, args.prefill) for name in cfgs}
  pre = {name: args.batch * args.prefill / v[0]
         for name, v in interleaved(runs, max(2, args.reps // 3)).items()}
  print(f"prefill of {args.prefill} tokens (chunks of 512): hybrid {pre['hybrid']:.0f} tok/s, "
        f"all-MLA {pre['all-MLA']:.0f} tok/s, hybrid / all-MLA "
        f"{pre['hybrid'] / pre['all-MLA']:.2f}x")
  shortest, longest = min(results), max(results)
  ratio = results[longest]["all-MLA"] / results[longest]["hybrid"]
  weight_ratio = results[shortest]["hybrid"] / bound
  print(f"goal: all-MLA / hybrid at {longest} >= 3x: {ratio:.2f}x "
        f"{'MET' if ratio >= 3 else 'NOT MET'}")
  print(f"goal: hybrid decode at {shortest} within 2x of the matmul bound: {weight_ratio:.2f}x "
        f"{'MET' if weight_ratio <= 2 else 'NOT MET'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
