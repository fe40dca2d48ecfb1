"""KDA on the CPU: tokens/s of our jnp backends next to tokamax's and transformers' KDA.

    python benchmarks/kda_cpu.py              # B=1, T=4096, H=8, K=V=128, float32
    python benchmarks/kda_cpu.py --T 8192 --H 4
    python benchmarks/kda_cpu.py --quick      # T=512, H=2: a smoke run

Every implementation computes the same thing: the K3 gate g = -5 sigmoid(exp(A) (x + dt_bias)) and
q/k l2norm fused into the op (tokamax: use_gate_in_kernel / use_qk_l2norm; ours: RawInputs(gate=,
use_qk_l2norm=); transformers: written out in torch, with use_qk_l2norm_in_kernel), beta given after
its sigmoid. "fwd+bwd" is the gradient of sum(o * w) w.r.t. q, k, v, the raw gate and beta. JAX
functions are jitted and warmed up; each number is the median of --reps timed runs
(block_until_ready), every implementation timed in its own block. tokamax gets its inputs already in
its [H, B, T, K] layout (no transposes timed); ours take [B, T, H, K].

The naive backend (a per-token scan) is timed forward at full T, but its backward only at
--naive-T tokens (it is ~2 orders of magnitude slower): its fwd+bwd tokens/s is for that T.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.modules.setdefault("fla", None)  # transformers would pick fla's Triton kernels otherwise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._timing import timed  # noqa: E402
from pallas_kernels.kda import RawInputs, kda  # noqa: E402

LOWER_BOUND = -5.0
RAW = RawInputs(gate="lower_bound", lower_bound=LOWER_BOUND, use_qk_l2norm=True)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--B", type=int, default=1)
  p.add_argument("--T", type=int, default=4096)
  p.add_argument("--H", type=int, default=8)
  p.add_argument("--K", type=int, default=128, help="key and value head dim")
  p.add_argument("--reps", type=int, default=5, help="timed runs per number (median)")
  p.add_argument("--naive-T", type=int, default=512, help="T for the naive backend's backward")
  p.add_argument("--torch-reps", type=int, default=1,
                 help="timed runs for transformers' torch KDA (slow: a Python loop per row)")
  p.add_argument("--quick", action="store_true", help="T=512, H=2, 3 reps")
  args = p.parse_args(argv)
  if args.quick:
    args.T, args.H, args.reps, args.naive_T = 512, 2, 3, 256
  return args


def make_inputs(B, T, H, K, seed=0):
  ks = jax.random.split(jax.random.key(seed), 8)
  q, k, v, x = (jax.random.normal(ks[i], (B, T, H, K), jnp.float32) for i in range(4))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
  a_log = jnp.log(jax.random.uniform(ks[5], (H,), minval=1.0, maxval=16.0))
  dt_bias = 0.5 * jax.random.normal(ks[6], (H, K), jnp.float32)
  w = jax.random.normal(ks[7], (B, T, H, K), jnp.float32)
  return (q, k, v, x, beta), (a_log, dt_bias), w


def ours(backend, params, w):
  a_log, dt_bias = params

  def fwd(q, k, v, x, beta):
    return kda(q, k, v, x, beta, backend=backend, A_log=a_log, dt_bias=dt_bias, raw=RAW)[0]

  loss = lambda *a: jnp.sum(fwd(*a) * w[:, :a[0].shape[1]])
  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def tokamax_kda(params, w):
  import tokamax

  a_log, dt_bias = params
  H, K = dt_bias.shape
  w_hbtk = jnp.moveaxis(w, 2, 0)

  def fwd(q, k, v, x, beta):  # [H, B, T, K] in and out
    return tokamax.ops.kimi_delta_attention(
        q, k, v, x, beta, a_log=a_log, delta_time_bias=dt_bias.reshape(H * K),
        use_gate_in_kernel=True, lower_bound=LOWER_BOUND, use_qk_l2norm=True,
        implementation="xla_chunked")[0]

  loss = lambda *a: jnp.sum(fwd(*a) * w_hbtk)
  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def torch_kda(params, w):
  import torch
  from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

  a = torch.tensor(np.exp(np.asarray(params[0])))[:, None]
  dt_bias = torch.tensor(np.asarray(params[1]))
  w = torch.tensor(np.asarray(w))

  def fwd(q, k, v, x, beta):
    g = LOWER_BOUND * torch.sigmoid(a * (x + dt_bias))
    return chunk_kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

  def run_fwd(*xs):
    with torch.no_grad():
      return fwd(*xs)

  def run_fwdbwd(*xs):
    xs = [x.detach().requires_grad_() for x in xs]
    (fwd(*xs) * w).sum().backward()
    return [x.grad for x in xs]

  return run_fwd, run_fwdbwd


def torch_timed(fn, *args, reps):
  """Median wall seconds; no warm-up (nothing to compile)."""
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(*args)
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None):
  args = parse_args(argv)
  B, T, H, K = args.B, args.T, args.H, args.K
  xs, params, w = make_inputs(B, T, H, K)
  print(f"KDA on {jax.devices()[0].device_kind} ({os.cpu_count()} CPUs), B={B} T={T} H={H} "
        f"K=V={K} float32, median of {args.reps}; tokens/s = B*T / seconds", flush=True)
  rows = {}  # name -> (fwd tok/s, fwd+bwd tok/s, note)

  fwd, fwdbwd = ours("xla_cpu", params, w)
  rows["ours xla_cpu"] = (B * T / timed(fwd, *xs, reps=args.reps),
                          B * T / timed(fwdbwd, *xs, reps=args.reps), "")

  fwd, fwdbwd = ours("naive", params, w)
  short = tuple(x[:, :args.naive_T] for x in xs)
  rows["ours naive"] = (B * T / timed(fwd, *xs, reps=args.reps),
                        B * args.naive_T / timed(fwdbwd, *short, reps=args.reps),
                        f"fwd+bwd at T={args.naive_T}")

  try:
    fwd, fwdbwd = tokamax_kda(params, w)
    hbtk = tuple(jnp.moveaxis(x, 2, 0) for x in xs)
    rows["tokamax xla_chunked"] = (B * T / timed(fwd, *hbtk, reps=args.reps),
                                   B * T / timed(fwdbwd, *hbtk, reps=args.reps), "")
  except ImportError as e:
    print(f"tokamax not available: {e}")

  try:
    import torch
    fwd, fwdbwd = torch_kda(params, w)
    txs = [torch.tensor(np.asarray(x)) for x in xs]
    reps = args.torch_reps
    rows["transformers torch chunk"] = (B * T / torch_timed(fwd, *txs, reps=reps),
                                        B * T / torch_timed(fwdbwd, *txs, reps=reps),
                                        f"torch {torch.__version__}, "
                                        f"{torch.get_num_threads()} threads")
  except ImportError as e:
    print(f"transformers / torch not available: {e}")

  ref = {n: rows[n] for n in ("tokamax xla_chunked", "transformers torch chunk") if n in rows}
  header = f"{'':26s} {'fwd tok/s':>10s} {'fwd+bwd tok/s':>14s}"
  for n in ref:
    header += f"   x {n.split()[0]:8s} fwd / fwd+bwd"
  print(header)
  for name, (f, fb, note) in rows.items():
    line = f"{name:26s} {f:10.0f} {fb:14.0f}"
    for rf, rfb, _ in ref.values():
      line += f"   {f / rf:6.2f} / {fb / rfb:5.2f}{'':13s}"
    print(line + (f"   ({note})" if note else ""))


if __name__ == "__main__":
  main()
