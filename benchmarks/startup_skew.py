"""Two processes whose first collective starts `--skew` seconds apart (one sleeps, as a slower
compiler would) must both finish (docs/sharding.md#multi-host).

Each try starts a pair of processes (1 CPU device each, gloo collectives, a fresh port), compiles
a cross-process sum, waits at `sharding.distributed.barrier` (unless --no-barrier) and runs it;
the tries run concurrently. Prints one line per try and `ok K of N`.

  python benchmarks/startup_skew.py --tries 10 --skew 40            # the barrier: K == N
  python benchmarks/startup_skew.py --tries 1 --skew 40 --no-barrier  # gloo's 30 s kills it
"""

import argparse
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from sharding import distributed
port, pid, skew, use_barrier = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
distributed.initialize(f"localhost:{port}", 2, pid)
mesh = jax.make_mesh((2,), ("data",), devices=jax.devices())
sh = NamedSharding(mesh, P("data"))
x = jax.make_array_from_callback((2,), sh, lambda idx: np.full((1,), pid + 1.0))
total = jax.jit(lambda v: jnp.sum(v), out_shardings=NamedSharding(mesh, P()))
compiled = total.lower(x).compile()
if pid == 1:
  time.sleep(skew)  # the slower compiler
if use_barrier:
  distributed.barrier("startup-skew", 600)
got = float(compiled(x))
assert got == 3.0, got
print("sum", got)
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tries", type=int, default=10)
  p.add_argument("--skew", type=float, default=40.0)
  p.add_argument("--no-barrier", action="store_true")
  p.add_argument("--timeout", type=float, default=300.0,
                 help="seconds past the skew after which a try counts as failed")
  args = p.parse_args()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  t0 = time.time()
  pairs = []
  for _ in range(args.tries):
    port = str(free_port())
    pairs.append([subprocess.Popen(
        [sys.executable, "-c", WORKER, port, str(i), str(args.skew),
         "0" if args.no_barrier else "1"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)])
  ok = 0
  # a failed pair does not exit by itself: the failing process waits in jax.distributed's
  # shutdown for its peer, which waits in the collective; past the deadline both are killed
  deadline = time.time() + args.skew + args.timeout
  for t, pair in enumerate(pairs):
    logs = []
    for proc in pair:
      try:
        logs.append(proc.communicate(timeout=max(deadline - time.time(), 1))[0])
      except subprocess.TimeoutExpired:
        for q in pair:
          q.kill()
        logs.append(proc.communicate()[0])
    good = all(proc.returncode == 0 for proc in pair)
    ok += good
    why = "" if good else " | " + next(
        (line for log in logs for line in log.splitlines() if "rror" in line), "no error line")
    print(f"try {t}: {'ok' if good else 'FAILED'} (exit {[proc.returncode for proc in pair]})"
          f"{why[:300]}", flush=True)
  print(f"ok {ok} of {args.tries} (skew {args.skew:g} s, barrier {not args.no_barrier}, "
        f"{time.time() - t0:.0f} s)")


if __name__ == "__main__":
  main()
