"""Per-host streaming load: the bytes each process of a multi-process run reads from a released
safetensors folder (convert/stream.py), and its peak host memory.

    python benchmarks/load_processes.py MODEL_DIR [--processes 2] [--mesh fsdp=2,tensor=2,...]

Starts N local processes (gloo, a localhost coordinator), each with 8/N CPU devices, that
load MODEL_DIR onto the mesh in the rules table's shardings (`load_folder_sharded`: each
process reads only the boxes of its devices' shards; MXFP4 experts as their packed bytes) and
print the source bytes they read against the checkpoint's tensor bytes, with their peak RSS.
On a pod each host does the same with its own devices.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

WORKER = """
import json, sys
import jax
from convert.load import named_shardings
from convert.source import items_to_read, open_source
from convert.stream import load_folder_sharded
from k3jax.execution import Execution
from sharding.distributed import initialize
from sharding.mesh import make_mesh
folder, port, mesh = sys.argv[1], sys.argv[2], sys.argv[5]
n, pid = int(sys.argv[3]), int(sys.argv[4])
initialize(f"localhost:{port}", n, pid)
source = open_source(folder)
ex = Execution(dtype="bfloat16", param_dtype="bfloat16")
arrays = load_folder_sharded(source, source.cfg, ex,
                             named_shardings(source.cfg, make_mesh(mesh, jax.devices())))
jax.block_until_ready(list(arrays.values()))
total = sum(p.info.nbytes for it in items_to_read(source) for p in it.parts)
rss = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]
print(json.dumps({"process": pid, "read": source.reader.bytes_read, "total": total,
                  "peak_rss_kib": int(rss)}))
jax.distributed.shutdown()
"""


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("model_dir")
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--mesh", default="fsdp=2,expert=2,tensor=2",
                 help="over the 8 CPU devices of all processes")
  a = p.parse_args()
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // a.processes}"}
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, a.model_dir, str(port),
                             str(a.processes), str(i), a.mesh], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(a.processes)]
  outs = [q.communicate(timeout=1800) for q in procs]
  rows = []
  for q, (out, err) in zip(procs, outs):
    if q.returncode != 0:
      raise SystemExit(f"a process failed:\n{err[-3000:]}")
    rows.append(json.loads(out.strip().splitlines()[-1]))
  total = rows[0]["total"]
  print(f"{a.model_dir}: {total / 2**20:.2f} MiB of tensors, mesh {a.mesh}, "
        f"{a.processes} processes")
  for r in rows:
    print(f"  process {r['process']}: read {r['read'] / 2**20:.2f} MiB "
          f"({r['read'] / total:.1%} of the checkpoint), peak RSS "
          f"{r['peak_rss_kib'] / 2**20:.2f} GiB")
  print("json:", json.dumps({"total": total, "processes": rows}))


if __name__ == "__main__":
  main()
