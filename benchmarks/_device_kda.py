"""device_check.py's KDA sections: the GPU backends against the chunked reference in float64,
their speed against the XLA chunked path, and fla's `chunk_kda` (torch, its own process).

Each section takes (rec, size, dry): `rec` a device_check.Record (results saved as they come),
`size` the run's Sizes, `dry` True on the CPU (the Pallas kernels in interpret mode).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kda import make_inputs as speed_inputs
from benchmarks.train import timed
from pallas_kernels.kda import ops, reference
from tests import numerics

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def gpu_backends(dry: bool) -> dict[str, str | None]:
  """{KDA GPU backend: None, or why it does not run here}; Mosaic GPU first (what sm_90+ runs),
  Triton last (its backward compiles for minutes)."""
  if dry:
    return {"pallas_mosaic_gpu": None, "pallas_gpu": None}
  cc = getattr(jax.devices()[0], "compute_capability", None)
  mosaic = ops.gpu_backend(cc) == "pallas_mosaic_gpu"
  return {"pallas_mosaic_gpu": None if mosaic else f"needs sm_90+ (this GPU: {cc})",
          "pallas_gpu": None}


def check_inputs(B, T, H, K, dtype, seed=0):
  """(q, k, v, g, beta, h0), segment ids, cotangents (wo, wh): unit q/k, K3's lower-bound gate
  at full strength (decays near e^-5 per token), two segments per row, a random initial state."""
  ks = jax.random.split(jax.random.key(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (B, T, H, K))).astype(dtype)
  k = unit(jax.random.normal(ks[1], (B, T, H, K))).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, H, K)).astype(dtype)
  g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (B, T, H, K)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  h0 = 0.5 * jax.random.normal(ks[5], (B, H, K, K))
  t = np.arange(T)
  seg = jnp.asarray(np.stack([t >= (T // 2 if b % 2 == 0 else 64) for b in range(B)]), jnp.int32)
  wo = jax.random.normal(ks[6], v.shape).astype(v.dtype).astype(jnp.float32)
  wh = jax.random.normal(ks[7], h0.shape)
  return (q, k, v, g, beta, h0), seg, (wo, wh)


def forward(fn, args, seg):
  q, k, v, g, beta, h0 = args
  return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=seg)


def gradient(fn, args, seg, cot):
  """Gradients of sum(o wo) + sum(ht wh) with respect to all six inputs."""
  wo, wh = cot

  def loss(*a):
    o, ht = forward(fn, a, seg)
    return jnp.sum(o.astype(wo.dtype) * wo) + jnp.sum(ht * wh)

  return jax.grad(loss, argnums=tuple(range(6)))(*args)


def decode(step, args, steps):
  """`steps` decode steps from h0 over the first tokens of args: (o [B, steps, H, V], state)."""
  q, k, v, g, beta, s = args
  outs = []
  for t in range(steps):
    o, s = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
    outs.append(o)
  return jnp.stack(outs, axis=1), s


def compare(got, want) -> dict:
  """`got` against its float64 truth with tests/numerics.py's derived tolerance (the CPU
  tests'): the largest error, the largest error over its tolerance, and whether it is <= 1."""
  got = np.asarray(got)
  tol = np.broadcast_to(numerics.tolerance_for(got.dtype, want), np.shape(want))
  err = np.abs(got.astype(np.float64) - np.asarray(want, np.float64))
  ratio = float(np.max(err / tol)) if err.size else 0.0
  return {"max_abs_err": float(err.max(initial=0.0)), "max_err_over_tol": ratio,
          "within_tol": bool(ratio <= 1.0)}


def kda_check(rec, size, dry) -> None:
  """Forward (o, final state), gradient (six inputs) and `check_steps` decode steps of each GPU
  backend, q/k/v in each of `check_dtypes`, against `reference.chunk_kda` in float64 on the same
  values."""
  B, T, H, K = size.check
  rec.put("shape", {"B": B, "T": T, "H": H, "K": K, "V": K, "decode_batch": size.check_batch,
                    "decode_steps": size.check_steps})
  backends = gpu_backends(dry)
  for name, why in backends.items():
    if why:
      rec.put(f"results/{name}/skipped", why)
  steps = size.check_steps
  runs = {  # what: (run(kda, kda_step, case), its float64 truth(case), its outputs' names)
      "forward": (lambda fn, step, c: forward(fn, c["args"], c["seg"]),
                  lambda c: forward(reference.chunk_kda, c["args"], c["seg"]),
                  ("o", "final_state")),
      "decode": (lambda fn, step, c: decode(step, c["step_args"], steps),
                 lambda c: forward(reference.chunk_kda, c["step_args"], None), ("o", "state")),
      "gradient": (lambda fn, step, c: gradient(fn, c["args"], c["seg"], c["cot"]),
                   lambda c: gradient(reference.chunk_kda, c["args"], c["seg"], c["cot"]),
                   GRAD_NAMES)}
  cases, truths = {}, {}
  for dtype in size.check_dtypes:
    args, seg, cot = check_inputs(B, T, H, K, jnp.dtype(dtype))
    step_args = check_inputs(size.check_batch, steps, H, K, jnp.dtype(dtype), seed=1)[0]
    cases[dtype] = {"args": args, "seg": seg, "cot": cot, "step_args": step_args}
    truths[dtype] = {what: numerics.float64_truth(jax.jit(t), cases[dtype])
                     for what, (_, t, _) in runs.items()}
  # forward and decode of every backend before any gradient, Triton's last (its backward
  # compiles for minutes): what a section stopped at its share leaves out is the least needed
  for what, (run, _, names) in runs.items():
    for name in (n for n, why in backends.items() if why is None):
      fn = lambda *a, name=name, **kw: ops.kda(*a, backend=name, interpret=dry, **kw)
      step = lambda *a, name=name: ops.kda_step(*a, backend=name, interpret=dry)
      for dtype, case in cases.items():
        where = f"results/{name}/{dtype}/{what}"
        with rec.part(where):
          t0 = time.perf_counter()
          got = jax.block_until_ready(run(fn, step, case))
          rec.put(where, {"seconds_with_compile": time.perf_counter() - t0, **{
              n: compare(x, w) for n, x, w in zip(names, got, truths[dtype][what])}})
  rec.put("within_tol", all_within(rec.data.get("results", {})))


def all_within(tree) -> bool:
  """Every comparison in the tree within its tolerance (and at least one made)."""
  found = [v["within_tol"] for v in _leaves(tree) if "within_tol" in v]
  return bool(found) and all(found)


def _leaves(tree):
  if isinstance(tree, dict):
    yield tree
    for v in tree.values():
      yield from _leaves(v)


def kda_speed(rec, size, dry) -> None:
  """Forward and forward+backward (gradient of sum(o) w.r.t. all five inputs) at `size.speed`,
  bf16 q/k/v, of `size.speed_backends`: the GPU backends and the XLA chunked path ("xla_cpu",
  the jnp backend any platform without a Pallas kernel runs; the dry run times it alone, its
  Pallas kernels checked in kda_check). Compile time apart, median of `size.reps` runs."""
  B, T, H, K = size.speed
  rec.put("shape", {"B": B, "T": T, "H": H, "K": K, "V": K, "dtype": "bfloat16"})
  args = speed_inputs(B, T, H, K)
  backends = gpu_backends(dry)
  for name in size.speed_backends:
    if backends.get(name):
      rec.put(f"results/{name}/skipped", backends[name])
  run = [n for n in size.speed_backends if not backends.get(n)]
  for mode in ("fwd", "fwd_bwd"):  # every forward first: Triton's backward compiles longest
    for name in run:
      fwd = lambda q, k, v, g, beta, name=name: ops.kda(q, k, v, g, beta, backend=name,
                                                        interpret=dry)[0]
      loss = lambda *a, fwd=fwd: jnp.sum(fwd(*a).astype(jnp.float32))
      fn = fwd if mode == "fwd" else jax.grad(loss, argnums=tuple(range(5)))
      with rec.part(f"results/{name}/{mode}"):
        compile_s, seconds = timed(fn, *args, iters=size.reps)
        rec.put(f"results/{name}/{mode}", {"seconds": seconds, "compile_s": compile_s,
                                           "tokens_per_s": B * T / seconds})


def kda_fla(rec, size, dry) -> None:
  """fla's Triton `chunk_kda` at `size.speed` (torch only: this process never starts JAX's GPU
  backend), same input distribution and dtypes as kda_speed; CUDA-event timing."""
  if dry:
    rec.put("skipped", "fla needs triton and a CUDA GPU")
    return
  import torch
  from fla.ops.kda import chunk_kda

  B, T, H, K = size.speed
  rec.put("shape", {"B": B, "T": T, "H": H, "K": K, "V": K, "dtype": "bfloat16"})
  rec.put("versions", {"torch": torch.__version__, "device": torch.cuda.get_device_name()})
  gen = torch.Generator(device="cuda").manual_seed(0)
  randn = lambda *s: torch.randn(*s, device="cuda", generator=gen)
  unit = lambda x: torch.nn.functional.normalize(x, dim=-1).to(torch.bfloat16)
  q, k = unit(randn(B, T, H, K)), unit(randn(B, T, H, K))
  v = randn(B, T, H, K).to(torch.bfloat16)
  g, beta = -5.0 * torch.sigmoid(randn(B, T, H, K)), torch.sigmoid(randn(B, T, H))
  leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
  runs = {"fwd": lambda: chunk_kda(q, k, v, g, beta),
          "fwd_bwd": lambda: chunk_kda(*leaves)[0].float().sum().backward()}
  for mode, run in runs.items():
    with rec.part(f"results/fla_chunk_kda/{mode}"), torch.set_grad_enabled(mode == "fwd_bwd"):
      t0 = time.perf_counter()
      run()  # Triton's autotuning and compile
      torch.cuda.synchronize()
      first = time.perf_counter() - t0
      seconds = _cuda_seconds(torch, run, size.reps)
      rec.put(f"results/fla_chunk_kda/{mode}", {"seconds": seconds, "compile_s": first,
                                                "tokens_per_s": B * T / seconds})


def _cuda_seconds(torch, run, reps: int) -> float:
  """Median seconds of run() over `reps` calls, each timed by CUDA events."""
  times = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  return float(np.median(times))
