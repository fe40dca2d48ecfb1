"""Consecutive two-process starts of one `k3jax train` run over one shared compilation cache
(docs/sharding.md#multi-host): how many finish, and which hang in their first step.

Each start runs `k3jax train --config CONFIG --steps 6 --dtype float64 --mesh
data=2,expert=2,tensor=2` on 2 processes x 4 CPU devices into a fresh --out, all starts with
the same --compile-cache (the first start fills it). A start whose processes both stop using
CPU for --stall seconds before finishing counts as hung and is killed. Each process logs the
persistent cache's hits and misses (JAX's compiler logger), so a start's line says which
process took its train step from the cache. One JSON line per start, then the count.

  python benchmarks/warm_starts.py --starts 8 --work /tmp/ws                 # this tree
  python benchmarks/warm_starts.py --starts 8 --work /tmp/ws --repo OLD_TREE # another tree
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = """
import logging, sys
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
for name in ("jax._src.compiler",):
  logger = logging.getLogger(name)
  logger.setLevel(logging.DEBUG)
  logger.addHandler(handler)
from k3jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
  except OSError:
    return None


def train_step_from_cache(log: str) -> bool | None:
  """Whether the process took its train step from the persistent cache (None: not said)."""
  with open(log) as f:
    text = f.read()
  if re.search(r"cache hit for 'jit_train'", text):
    return True
  if re.search(r"CACHE MISS for 'jit_train'", text):
    return False
  return None


def one_start(args, i: int, cache: str) -> dict:
  out = os.path.join(args.work, f"run{i}")
  line = ["train", "--config", args.config, "--steps", "6", "--dtype", "float64", "--mesh",
          "data=2,expert=2,tensor=2", "--out", out, "--compile-cache", cache, "--no-progress",
          "--no-plots", "--no-tensorboard", "--peak-tflops", "1", "--coordinator",
          f"localhost:{free_port()}", "--num-processes", "2", *args.extra]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": args.repo}
  procs, logs = [], []
  for p in range(2):
    logs.append(os.path.join(args.work, f"run{i}_p{p}.log"))
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-c", DRIVER, *line, "--process-id",
                                     str(p)], cwd=args.repo, env=env, stdout=log,
                                    stderr=subprocess.STDOUT))
  t0, last, changed, hung = time.monotonic(), None, time.monotonic(), False
  while any(p.poll() is None for p in procs):
    time.sleep(2)
    now = [cpu_seconds(p.pid) for p in procs]
    if now != last:
      last, changed = now, time.monotonic()
    elif time.monotonic() - changed > args.stall:
      hung = True
      break
  cpu = [cpu_seconds(p.pid) for p in procs]
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()
  return {"start": i, "hung": hung, "returncodes": [p.returncode for p in procs],
          "seconds": round(time.monotonic() - t0, 1), "cpu_s_when_hung": cpu if hung else None,
          "train_step_from_cache": [train_step_from_cache(log) for log in logs]}


def main() -> None:
  a = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  a.add_argument("--work", required=True, help="a folder for the runs, logs and the cache")
  a.add_argument("--starts", type=int, default=8)
  a.add_argument("--config", default="tiny")
  a.add_argument("--repo", default=REPO, help="the tree to run (default: this one)")
  a.add_argument("--stall", type=float, default=120.0,
                 help="seconds without CPU use that make a start hung")
  a.add_argument("extra", nargs="*", help="more `k3jax train` flags")
  args = a.parse_args()
  cache = os.path.join(args.work, "cache")
  os.makedirs(cache, exist_ok=True)
  results = []
  for i in range(args.starts):
    results.append(one_start(args, i, cache))
    print(json.dumps(results[-1]), flush=True)
  finished = sum(not r["hung"] and r["returncodes"] == [0, 0] for r in results)
  print(f"finished {finished} of {len(results)} starts; hung "
        f"{sum(r['hung'] for r in results)}", flush=True)


if __name__ == "__main__":
  main()
