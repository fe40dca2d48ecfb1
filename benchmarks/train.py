"""Train-step speed: tokens/s and model FLOP utilisation (MFU) of `k3jax train`'s jitted step.

    python benchmarks/train.py                      # tiny and the ~100M K3-shaped config
    python benchmarks/train.py --configs k3_100m --batch 4 --seq 512 --breakdown
    python benchmarks/train.py --configs k3_100m --grad-accum 4   # 4 micro-batches a step

MFU = model FLOPs of the step / step time / peak, where
  * model FLOPs = 3 x forward FLOPs x tokens, forward FLOPs per token as counted by
    k3jax/train/flops.py: 2 x active matmul parameters (routed experts at k/E, embedding lookup
    excluded, lm_head included) + MLA attention over the causal half + KDA's chunked core +
    AttnRes reads; rematerialisation is not counted;
  * peak = a dense [n, n] @ [n, n] matmul chain in the same dtype, measured in the same run on
    the same device (the practical peak: what XLA's best kernel reaches here), once before
    each timed step (`--iters` of them): on a shared machine the peak moves with the load
    (255 to 305 GFLOP/s between two runs), so each step is set against the peak measured
    beside it, and the spread (min / median / max of the peak and of that MFU) is printed;
    the headline MFU is the median.
The step is the real one (Per-Head Muon with clipping, Quantile Balancing, fp32 loss), on one
batch of random tokens (full rows, one segment each), timed after compilation.
`--breakdown` also times the parts of the step (the whole model's loss forward and
forward+backward without the optimizer, one KDA, MLA and MoE layer forward+backward,
the routed-expert grouped matmul, both implementations, against a dense matmul of the same
FLOPs, the optimizer update)
to show where the time goes.

Run as a script, it restarts itself with tcmalloc preloaded when tcmalloc is installed (see
k3jax/allocator.py: glibc malloc re-faults the step's temporaries every step, ~15% of the
~100M step on a CPU); K3JAX_ALLOCATOR=system keeps the system allocator. The header line says
which allocator ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import median_seconds
from k3jax import allocator
from k3jax.execution import Execution


def k3_100m():
  """~100M parameters with every K3 part: [KDA, KDA, KDA, MLA] x 2 + the trailing MLA, a
  dense first layer, LatentMoE (32 experts, top 4, latent 256, 2 shared) with QB, AttnRes blocks
  of 3, SiTU, KDA head_dim 128 as in K3. A 32k vocabulary keeps the head K3-like in proportion
  (byte-level would make the model all layers). Run with the loss in chunks of 512 positions
  (`model_config`), as K3's recipe runs it."""
  import configs
  return configs.get("tiny").replace(
      vocab_size=32768, hidden_size=512, num_layers=9, mla_layers=(3, 7, 8),
      kda_num_heads=4, kda_head_dim=128, mla_num_heads=4, q_lora_rank=192, kv_lora_rank=128,
      qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1536,
      num_experts=32, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=256,
      latent_size=256, attn_res_block_size=3)


def model_config(name: str, dtype: str, remat: bool):
  """(config, execution): `dtype` compute over fp32 master weights; k3_100m's loss in chunks
  of 512 positions (k3jax/train/loss.py: its own backward, no [tokens, vocab] buffers)."""
  import configs
  big = name == "k3_100m"
  cfg = k3_100m() if big else configs.resolve(name)
  return cfg, Execution(dtype=dtype, param_dtype="float32", remat=remat,
                        loss_chunk=512 if big else None)


def timed(fn, *args, iters: int) -> tuple[float, float]:
  """(compile seconds, median seconds per call) of jax.jit(fn)(*args)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  return compile_s, median_seconds(lambda: jax.block_until_ready(compiled(*args)), iters)


def spread(values: list[float]) -> dict[str, float]:
  return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def bench_step(cfg, ex, batch: int, seq: int, iters: int, peak, accum: int = 1) -> dict:
  """The step's figures; `peak()` measures the dense-matmul peak, once before each of the
  `iters` timed steps (interleaved, so the MFU of each step is against the peak of its
  moment)."""
  from k3jax.train import flops as flops_lib
  from k3jax.train import step as step_lib
  steps = step_lib.build(cfg, ex, step_lib.StepConfig(decay_steps=1000))
  params, bias = step_lib.init_params(cfg, ex, 0)
  state = step_lib.place(steps.init(params, bias, step_lib.new_rng(0)))
  rng = np.random.default_rng(0)
  shape = (accum, batch, seq)  # micro-batches, rows, positions
  data = {"inputs": rng.integers(0, cfg.vocab_size, shape).astype(np.int32),
          "targets": rng.integers(0, cfg.vocab_size, shape).astype(np.int32),
          "segment_ids": np.ones(shape, np.int32),
          "loss_mask": np.ones(shape, bool)}
  t0 = time.perf_counter()
  train = steps.train.lower(state, data, step_lib.NO_QK_CLIP).compile()
  compile_s = time.perf_counter() - t0

  def one_step():
    nonlocal state
    state, m = train(state, data, step_lib.NO_QK_CLIP)
    jax.block_until_ready(m)
  one_step()  # warm-up
  peaks, steps_s = [], []
  for _ in range(iters):
    peaks.append(peak())
    steps_s.append(_seconds(one_step))
  step_s = statistics.median(steps_s)
  count = flops_lib.count(cfg, seq)
  tokens = accum * batch * seq
  flops = count.train_per_token * tokens
  mfus = [flops / t / p for t, p in zip(steps_s, peaks, strict=True)]
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  return {
      "params": n_params, "active_matmul_params": count.active_matmul_params,
      "tokens_per_step": tokens, "compile_s": compile_s, "step_s": step_s,
      "tokens_per_s": tokens / step_s,
      "model_tflops_per_step": count.train_per_token * tokens / 1e12,
      "achieved_gflops": count.train_per_token * tokens / step_s / 1e9,
      "mfu": statistics.median(mfus),
      "mfu_spread": spread(mfus), "peak_gflops_spread": spread([p / 1e9 for p in peaks]),
      "step_s_spread": spread(steps_s),
      "newton_schulz_tflops_per_step": flops_lib.newton_schulz_flops(cfg) / 1e12,
      "flops_per_token_fwd": {"matmul": count.matmul, "mla_attention": count.mla_attention,
                              "kda_core": count.kda_core, "attn_res": count.attn_res},
  }


def _seconds(call) -> float:
  t0 = time.perf_counter()
  call()
  return time.perf_counter() - t0


def breakdown(cfg, ex, batch: int, seq: int, iters: int) -> dict[str, float]:
  """Seconds of forward+backward of one layer of each kind, and of the optimizer update."""
  from flax import nnx

  from k3jax.model.kda import KDA
  from k3jax.model.mla import MLA
  from k3jax.model.moe import MoE
  from k3jax.train import step as step_lib
  x = jax.random.normal(jax.random.key(0), (batch, seq, cfg.hidden_size), ex.jnp_dtype)
  seg = jnp.ones((batch, seq), jnp.int32)
  out = {}
  # the whole model's loss, forward and forward+backward (no optimizer, no QB)
  from k3jax.model.transformer import K3Model
  from k3jax.train.loss import model_nll
  graphdef, params, rest = nnx.split(K3Model(cfg, ex, rngs=nnx.Rngs(0)), nnx.Param, ...)
  ids = jax.random.randint(jax.random.key(3), (batch, seq + 1), 0, cfg.vocab_size)
  mask = jnp.ones((batch, seq), bool)

  def model_loss(params):
    out, nll_of = model_nll(nnx.merge(graphdef, params, rest), ids[:, :-1], seg)
    return jnp.mean(nll_of(out, ids[:, 1:], mask))

  out["model_fwd_s"] = timed(model_loss, params, iters=iters)[1]
  out["model_fwd_bwd_s"] = timed(jax.value_and_grad(model_loss), params, iters=iters)[1]
  for name, make in (("kda_layer", KDA), ("mla_layer", MLA), ("moe_layer", MoE)):
    graphdef, state = nnx.split(make(cfg, ex, rngs=nnx.Rngs(0)))

    def loss(state, x, graphdef=graphdef, name=name):
      layer = nnx.merge(graphdef, state)
      y = layer(x) if name == "moe_layer" else layer(x, segment_ids=seg)
      return jnp.sum(y[0].astype(jnp.float32) ** 2)

    out[name + "_fwd_bwd_s"] = timed(jax.grad(loss, argnums=(0, 1)), state, x, iters=iters)[1]
  # the routed experts' grouped matmul alone against a dense matmul of the same FLOPs
  m = batch * seq * cfg.num_experts_per_token
  h, f, e = cfg.latent_size or cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
  z = jax.random.normal(jax.random.key(1), (m, h), ex.jnp_dtype)
  w = jax.random.normal(jax.random.key(2), (e, h, f), ex.jnp_dtype)
  sizes = jnp.asarray(np.random.default_rng(0).multinomial(m, np.ones(e) / e), jnp.int32)
  from pallas_kernels.grouped_matmul import grouped_matmul
  dense = lambda z, w: jnp.sum((z @ w[0]) ** 2)
  for impl in ("tiled", "ragged_dot"):  # the model runs "tiled" on a CPU (default_impl)
    gmm = lambda z, w, impl=impl: jnp.sum(grouped_matmul(z, w, sizes, impl=impl) ** 2)
    out[f"expert_gmm_{impl}_fwd_bwd_s"] = timed(jax.grad(gmm, argnums=(0, 1)), z, w,
                                                iters=iters)[1]
  out["same_flops_dense_matmul_fwd_bwd_s"] = timed(jax.grad(dense, argnums=(0, 1)), z, w,
                                                   iters=iters)[1]
  steps = step_lib.build(cfg, ex, step_lib.StepConfig(decay_steps=1000))
  params, bias = step_lib.init_params(cfg, ex, 0)
  opt_state = steps.tx.init(params)

  def update(grads, opt_state, params):
    import optax
    updates, _ = steps.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates)

  out["optimizer_update_s"] = timed(update, params, opt_state, params, iters=iters)[1]
  counts = {"kda_layer": len(cfg.kda_layers), "mla_layer": len(cfg.mla_layers),
            "moe_layer": len(cfg.moe_layers)}
  out["layers_total_fwd_bwd_s"] = sum(out[k + "_fwd_bwd_s"] * n for k, n in counts.items())
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--configs", default="tiny,k3_100m",
                 help="comma list of presets / config files / k3_100m")
  p.add_argument("--batch", type=int, default=None, help="rows per step (default 8 / 4)")
  p.add_argument("--seq", type=int, default=None, help="positions per row (default 128 / 512)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--remat", action="store_true")
  p.add_argument("--grad-accum", type=int, default=1,
                 help="micro-batches of --batch rows per optimizer step")
  p.add_argument("--iters", type=int, default=3)
  p.add_argument("--breakdown", action="store_true", help="also time the parts of the step")
  p.add_argument("--json", action="store_true", help="print one JSON object per config")
  a = p.parse_args(argv)
  from k3jax.train.flops import measure_matmul_peak
  dtype = jnp.dtype(a.dtype)
  peak = lambda: max(measure_matmul_peak(dtype, n=2048), measure_matmul_peak(dtype, n=1024))
  print(f"platform {jax.default_backend()}, {os.cpu_count()} CPUs, {allocator.active()} "
        f"malloc; dense matmul peak ({a.dtype}) measured before each of the {a.iters} timed "
        "steps", flush=True)
  for name in a.configs.split(","):
    big = name == "k3_100m"
    batch, seq = a.batch or (4 if big else 8), a.seq or (512 if big else 128)
    cfg, ex = model_config(name, a.dtype, a.remat)
    r = bench_step(cfg, ex, batch, seq, a.iters, peak, a.grad_accum)
    print(f"{name}: {r['params'] / 1e6:.1f}M params ({r['active_matmul_params'] / 1e6:.1f}M "
          f"active matmul), batch {a.grad_accum} x {batch} x {seq}: compile "
          f"{r['compile_s']:.0f}s, step "
          f"{r['step_s']:.3f}s, {r['tokens_per_s']:.0f} tokens/s, "
          f"{r['achieved_gflops']:.1f} model GFLOP/s = MFU {100 * r['mfu']:.1f}%", flush=True)
    pk, mf, st = r["peak_gflops_spread"], r["mfu_spread"], r["step_s_spread"]
    print(f"  spread over {a.iters} steps (min / median / max): peak {pk['min']:.1f} / "
          f"{pk['median']:.1f} / {pk['max']:.1f} GFLOP/s, step {st['min']:.3f} / "
          f"{st['median']:.3f} / {st['max']:.3f} s, MFU {100 * mf['min']:.1f} / "
          f"{100 * mf['median']:.1f} / {100 * mf['max']:.1f}%", flush=True)
    print(f"  per step: model {r['model_tflops_per_step']:.3f} TFLOP, Per-Head Muon's "
          f"Newton-Schulz {r['newton_schulz_tflops_per_step']:.3f} TFLOP (not in the MFU; once "
          "per step whatever the batch: --grad-accum amortises it)", flush=True)
    fwd = r["flops_per_token_fwd"]
    total = sum(fwd.values())
    print("  forward FLOPs/token: " + ", ".join(
        f"{k} {v / 1e6:.2f}M ({100 * v / total:.0f}%)" for k, v in fwd.items()), flush=True)
    if a.breakdown:
      b = breakdown(cfg, ex, batch, seq, a.iters)
      r["breakdown"] = b
      print("  breakdown (fwd+bwd seconds): " + ", ".join(
          f"{k.removesuffix('_s')} {v:.3f}" for k, v in b.items()), flush=True)
    if a.json:
      print(json.dumps({"config": name, "batch": batch, "seq": seq, "dtype": a.dtype,
                        "peak_gflops": r["peak_gflops_spread"]["median"], **r}))
  return 0


if __name__ == "__main__":
  allocator.reexec_with_tcmalloc(sys.argv)
  sys.exit(main())
