"""KDA speed: tokens/s, forward and forward+backward, for every backend this machine can run.

    python benchmarks/kda.py                        # the full grid on an accelerator
    python benchmarks/kda.py --B 1 --T 4096 --H 8   # a quick point
    python benchmarks/kda.py --quick                # tiny smoke grid (what CPU runs by default)

Backends: "naive", "chunked" (the plain references) and "xla_cpu" (the fast jnp backend) through
`pallas_kernels.kda.ops.kda(backend=...)`, our Pallas kernels (`kda_tpu` on TPU; on GPU
`kda_gpu` (Triton) and `kda_mosaic_gpu` (Mosaic GPU, sm_90+)), and the outside
reference next to them as ratios: on a TPU tokamax's Mosaic KDA
(`tokamax.ops.kimi_delta_attention(..., implementation="mosaic")`), on a GPU fla's Triton
`chunk_kda`. Inputs: K=V=128 (by default), q/k/v bf16, g = -5*sigmoid(x) float32, beta float32.
On CPU the Pallas kernels would only run in interpret mode, far too slow to mean anything: they
are skipped with a note unless --interpret is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp

FULL_GRID = dict(B=[1, 2, 4, 8], T=[4096, 16384, 65536], H=[8, 32, 96])
QUICK_GRID = dict(B=[1], T=[256], H=[2])


@dataclasses.dataclass
class Result:
  fwd_s: float | None = None
  fwdbwd_s: float | None = None
  note: str = ""


def _ints(s):
  return [int(x) for x in s.split(",")]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--B", type=_ints, help="batch sizes, comma separated")
  p.add_argument("--T", type=_ints, help="sequence lengths")
  p.add_argument("--H", type=_ints, help="head counts")
  p.add_argument("--K", type=int, default=128, help="key and value head dim")
  p.add_argument("--quick", action="store_true", help="tiny grid (default on CPU)")
  p.add_argument("--backends", default="auto",
                 help="comma list among naive,chunked,xla_cpu,pallas,mosaic,reference (default: "
                 "all available; mosaic = the Mosaic GPU kernel, on GPU by default)")
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--naive-max-tokens", type=int, default=8192,
                 help="skip the naive recurrence above this B*T (it is token-serial)")
  p.add_argument("--interpret", action="store_true",
                 help="on CPU, run the Pallas kernels in interpret mode anyway (tiny shapes only)")
  return p.parse_args(argv)


def make_inputs(B, T, H, K, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  unit = lambda x: (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)
  q = unit(jax.random.normal(ks[0], (B, T, H, K), jnp.float32))
  k = unit(jax.random.normal(ks[1], (B, T, H, K), jnp.float32))
  v = jax.random.normal(ks[2], (B, T, H, K), jnp.bfloat16)
  g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K), jnp.float32))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
  return q, k, v, g, beta


def _time_jax(fn, args, iters, warmup):
  fn = jax.jit(fn)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def _jax_modes(kda_fn, args, modes, iters, warmup):
  """kda_fn(q, k, v, g, beta) -> o. Times forward and grad of sum(o * w)."""
  res = Result()
  if "fwd" in modes:
    res.fwd_s = _time_jax(kda_fn, args, iters, warmup)
  if "fwdbwd" in modes:
    def loss(q, k, v, g, beta):
      return jnp.sum(kda_fn(q, k, v, g, beta).astype(jnp.float32))
    res.fwdbwd_s = _time_jax(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args, iters, warmup)
  return res


# --- backends -------------------------------------------------------------------------------

def ops_backend(name):
  def run(args, modes, iters, warmup):
    try:
      from pallas_kernels.kda import ops  # lazy: written concurrently, may not exist yet
    except ImportError as e:
      return Result(note=f"pallas_kernels.kda.ops not importable ({e})")
    fn = lambda q, k, v, g, beta: ops.kda(q, k, v, g, beta, backend=name)[0]
    return _jax_modes(fn, args, modes, iters, warmup)
  return run


def pallas_backend(platform, interpret, mosaic_gpu=False):
  def run(args, modes, iters, warmup):
    if mosaic_gpu:
      if platform != "gpu" and not interpret:
        return Result(note="skipped: Mosaic GPU needs an sm_90+ GPU (or --interpret)")
      from pallas_kernels.kda.mosaic_gpu import kda_mosaic_gpu as kda_fn
    elif platform == "tpu":
      from pallas_kernels.kda.tpu import kda_tpu as kda_fn
    elif platform == "gpu":
      from pallas_kernels.kda.gpu import kda_gpu as kda_fn
    elif interpret:
      from pallas_kernels.kda.tpu import kda_tpu as kda_fn
    else:
      return Result(note="skipped on CPU: Pallas kernels only run in interpret mode here "
                    "(pass --interpret for a tiny smoke run)")
    fn = lambda q, k, v, g, beta: kda_fn(q, k, v, g, beta, interpret=interpret)[0]
    return _jax_modes(fn, args, modes, iters, warmup)
  return run


def tokamax_backend(args, modes, iters, warmup):
  import tokamax  # lazy: TPU only

  hb = lambda x: jnp.moveaxis(x, 2, 0)  # tokamax wants [H,B,T,*]
  args = tuple(map(hb, args))

  def fn(q, k, v, g, beta):
    return tokamax.ops.kimi_delta_attention(q, k, v, g, beta, implementation="mosaic")[0]
  return _jax_modes(fn, args, modes, iters, warmup)


def fla_backend(args, modes, iters, warmup):
  import numpy as np
  import torch
  from fla.ops.kda import chunk_kda  # lazy: needs Triton and a CUDA GPU

  to_t = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(
      torch.bfloat16 if x.dtype == jnp.bfloat16 else torch.float32)
  q, k, v, g, beta = map(to_t, args)
  res = Result()

  def timed(step):
    for _ in range(warmup):
      step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
      step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters

  if "fwd" in modes:
    with torch.no_grad():
      res.fwd_s = timed(lambda: chunk_kda(q, k, v, g, beta))
  if "fwdbwd" in modes:
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    res.fwdbwd_s = timed(lambda: chunk_kda(*leaves)[0].float().sum().backward())
  return res


def available_backends(platform, wanted, interpret):
  out = {}
  if wanted in ("auto",) or "naive" in wanted:
    out["naive"] = ops_backend("naive")
  if wanted in ("auto",) or "chunked" in wanted:
    out["chunked"] = ops_backend("chunked")
  if wanted in ("auto",) or "xla_cpu" in wanted:
    out["xla_cpu"] = ops_backend("xla_cpu")
  if wanted in ("auto",) or "pallas" in wanted:
    out[f"pallas_{platform}"] = pallas_backend(platform, interpret)
  if (wanted == "auto" and platform == "gpu") or "mosaic" in wanted:
    out["pallas_mosaic_gpu"] = pallas_backend(platform, interpret, mosaic_gpu=True)
  if wanted in ("auto",) or "reference" in wanted:
    if platform == "tpu":
      out["tokamax_mosaic"] = tokamax_backend
    elif platform == "gpu":
      out["fla_chunk_kda"] = fla_backend
    else:
      print("note: no outside reference on CPU (tokamax Mosaic needs a TPU, fla needs a GPU)")
  return out


def main(argv=None):
  a = parse_args(argv)
  platform = jax.default_backend()
  grid = QUICK_GRID if (a.quick or (platform == "cpu" and not (a.B or a.T or a.H))) else FULL_GRID
  Bs, Ts, Hs = a.B or grid["B"], a.T or grid["T"], a.H or grid["H"]
  modes = a.modes.split(",")
  backends = available_backends(platform, a.backends, a.interpret)
  ref_name = {"tpu": "tokamax_mosaic", "gpu": "fla_chunk_kda"}.get(platform, "xla_cpu")
  print(f"platform={platform} devices={jax.devices()} K=V={a.K} bf16 q/k/v; backends="
        f"{list(backends)}; ratios are tokens/s relative to {ref_name}")
  if platform == "cpu" and not a.interpret:
    print("note: Pallas kernels skipped on CPU (interpret mode only; --interpret to force)")
  header = f"{'B':>2} {'T':>6} {'H':>3} {'backend':>16} {'fwd tok/s':>12} {'fwd+bwd tok/s':>14} " \
           f"{'fwd x':>7} {'f+b x':>7}  note"
  print(header)
  for B, T, H in itertools.product(Bs, Ts, Hs):
    args = make_inputs(B, T, H, a.K)
    results = {}
    for name, run in backends.items():
      if name == "naive" and B * T > a.naive_max_tokens:
        results[name] = Result(note=f"skipped: B*T > --naive-max-tokens={a.naive_max_tokens}")
        continue
      try:
        results[name] = run(args, modes, a.iters, a.warmup)
      except Exception as e:  # noqa: BLE001 - one failing backend (OOM, missing) must not end the sweep
        results[name] = Result(note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    ref = results.get(ref_name, Result())
    for name, r in results.items():
      tps = lambda s: B * T / s if s else None  # noqa: B023 - called in this iteration only
      fmt = lambda x, w: f"{x:>{w}.3g}" if x else f"{'-':>{w}}"
      ratio = lambda s, rs: (rs / s) if (s and rs) else None
      print(f"{B:>2} {T:>6} {H:>3} {name:>16} {fmt(tps(r.fwd_s), 12)} {fmt(tps(r.fwdbwd_s), 14)} "
            f"{fmt(ratio(r.fwd_s, ref.fwd_s), 7)} "
            f"{fmt(ratio(r.fwdbwd_s, ref.fwdbwd_s), 7)}  {r.note}",
            flush=True)


if __name__ == "__main__":
  main()
