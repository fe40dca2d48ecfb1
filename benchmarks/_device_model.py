"""device_check.py's model sections: a train step of the ~100M K3-shaped model and the
engine's decode step.

Each section takes (rec, size, dry) as in _device_kda.py.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax.numpy as jnp
from flax import nnx

from benchmarks._device_ops import copy_bandwidth, this_chip
from benchmarks.decode import active_weight_params
from benchmarks.train import bench_step, k3_100m, model_config
from k3jax.engine import Engine, EngineConfig, SamplingParams
from k3jax.execution import Execution
from k3jax.model.transformer import K3Model
from k3jax.train.flops import measure_matmul_peak


def model(name: str):
  """(config, execution) of a model named in device_check.Sizes: benchmarks/train.py's k3_100m
  in bf16 over fp32 master weights (its loss in chunks of 512), or "micro", a 2-layer model of
  the same parts (KDA with the dense MLP, MLA with LatentMoE) for the dry run."""
  if name == "k3_100m":
    return model_config("k3_100m", "bfloat16", remat=False)
  cfg = k3_100m().replace(vocab_size=512, hidden_size=128, num_layers=2, mla_layers=(1,),
                          kda_num_heads=1, mla_num_heads=2, q_lora_rank=64, kv_lora_rank=32,
                          intermediate_size=256, num_experts=4, num_experts_per_token=2,
                          num_shared_experts=1, moe_intermediate_size=64, latent_size=64,
                          attn_res_block_size=2)
  return cfg, Execution(dtype="bfloat16", param_dtype="float32")


def model_kda_backend(rec, dry: bool, what: tuple[str, ...]) -> tuple[str | None, str]:
  """(the KDA backend the model sections run, why): the platform's default GPU backend, or the
  other one, whose bf16 `what` checks (kda_check: "forward", "gradient", "decode") all ran
  within tolerance on this device; else the XLA chunked path. None (the platform's default) on
  a dry run or when kda_check did not run."""
  if dry:
    return None, "dry run: the platform's default"
  results = rec.sibling("kda_check").get("results", {})
  if not results:
    return None, "no kda_check results in this run: the platform's default"
  for name in ("pallas_mosaic_gpu", "pallas_gpu"):
    checks = [results.get(name, {}).get("bfloat16", {}).get(w, {}) for w in what]
    if all(c and "error" not in c and all(v.get("within_tol", True) for v in c.values()
                                             if isinstance(v, dict)) for c in checks):
      return name, f"its bf16 {'/'.join(what)} checks passed on this device"
  return "xla_cpu", f"no Pallas GPU backend passed its bf16 {'/'.join(what)} checks"


def train(rec, size, dry) -> None:
  """`benchmarks/train.py`'s step (Per-Head Muon, Quantile Balancing) of `size.train_model` in
  bf16 over fp32 master weights: MFU against the chip table's bf16 dense peak and against the
  bf16 matmul peak measured before each timed step."""
  cfg, ex = model(size.train_model)
  backend, why = model_kda_backend(rec, dry, ("forward", "gradient"))
  ex = dataclasses.replace(ex, kda_backend=backend)
  batch, seq, iters = size.train_shape
  rec.put("setup", {"model": size.train_model, "batch": batch, "seq": seq, "iters": iters,
                    "dtype": ex.dtype, "kda_backend": backend or "default", "why": why})
  peak = lambda: measure_matmul_peak(jnp.bfloat16, n=size.matmul_n)
  with rec.part("results"):
    r = bench_step(cfg, ex, batch, seq, iters, peak)
    chip = this_chip()
    r["mfu_vs_chip_peak"] = r["achieved_gflops"] * 1e9 / chip["peak_bf16_flops"] if chip else None
    rec.put("results", r)


def decode(rec, size, dry) -> None:
  """The engine's decode step (a block of 8 decode steps per call, as `benchmarks/serve.py`
  runs it, divided by 8) at each batch in `size.decode_batches`, against the time to read the
  active weights once at the HBM bandwidth the device section measured."""
  cfg, _ = model(size.decode_model)
  backend, why = model_kda_backend(rec, dry, ("decode",))
  ex = Execution(dtype="bfloat16", param_dtype="bfloat16", kda_backend=backend)
  bandwidth = rec.sibling("device").get("hbm_bandwidth") or copy_bandwidth(size.copy_mib,
                                                                           size.reps)
  weight_bytes = active_weight_params(cfg) * jnp.dtype(ex.param_dtype).itemsize
  rec.put("setup", {"model": size.decode_model, "prompt": size.decode_prompt,
                    "blocks": size.decode_blocks, "dtype": ex.dtype,
                    "kda_backend": backend or "default", "why": why,
                    "active_weight_bytes": weight_bytes, "hbm_bandwidth": bandwidth})
  k3 = K3Model(cfg, ex, rngs=nnx.Rngs(0))
  for batch in size.decode_batches:
    with rec.part(f"results/{batch}"):
      step_s = engine_decode_step(k3, batch, size.decode_prompt, size.decode_blocks)
      bound = weight_bytes / bandwidth
      rec.put(f"results/{batch}", {"step_s": step_s, "weights_bound_s": bound,
                                   "over_bound": step_s / bound})


def engine_decode_step(model, batch: int, prompt: int, blocks: int) -> float:
  """Median seconds per decode step of the engine's decode blocks: `batch` requests read in one
  step, then `blocks` blocks of 8 steps; the second of two identical runs (the first compiles)."""
  length = prompt + 8 * blocks + 1
  config = EngineConfig(max_num_seqs=batch, max_model_len=length, prefill_chunk=prompt,
                        prefill_rows=batch, prefix_cache=False, max_top_logprobs=1,
                        min_decode_rows=batch, min_context=length, decode_steps=8)
  engine = Engine(model, config)
  per_step = []
  for _ in range(2):
    per_step = []
    for i in range(batch):
      engine.add(f"r{i}", [1 + (i + j) % 97 for j in range(prompt)],
                 SamplingParams(max_tokens=1 + 8 * blocks, temperature=0.0, ignore_eos=True))
    while engine.has_work():
      reading = bool(engine.scheduler.waiting)
      t0 = time.perf_counter()
      outs = engine.step()
      seconds = time.perf_counter() - t0
      tokens = max([len(o.token_ids) for o in outs] + [1])
      if not reading and tokens > 1:
        per_step.append(seconds / tokens)
  return statistics.median(per_step)
