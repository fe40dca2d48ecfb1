"""`distributed.from_main` and `distributed.fetch` in 2 processes x 2 CPU devices (gloo), the
two cross-process reads of `k3jax rl` (its 2-process run is a `long` test of
tests/k3jax/rl/test_run.py): process 0's numpy values reach the other bit for bit, float64
without jax_enable_x64 included, and an array whose shards span both processes is read whole
on each."""

import os
import subprocess
import sys

import numpy as np

from .test_multiprocess import REPO, free_port

SCRIPT = """
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from sharding import distributed

pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
distributed.initialize(f"localhost:{port}", 2, pid)
rng = np.random.default_rng(pid)  # other values on each process
got = distributed.from_main((rng.standard_normal((3, 2)), rng.random((3, 2)) < 0.5,
                             np.asarray(pid + 7, np.int32)))
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("rows",))
full = np.arange(12.0, dtype=np.float32).reshape(4, 3)
x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, PartitionSpec("rows")),
                                 lambda index: full[index])
np.savez(out, reals=got[0], bools=got[1], count=got[2], fetched=distributed.fetch(x),
         addressable=x.is_fully_addressable, x64=jax.config.jax_enable_x64)
"""


def test_process_0s_values_and_a_cross_process_array_reach_every_process(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "JAX_ENABLE_X64": "0",
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(
             "--xla_force_host_platform_device_count=8", "")
         + " --xla_force_host_platform_device_count=2"}
  port = free_port()
  outs = [str(tmp_path / f"p{i}.npz") for i in range(2)]
  procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(i), str(port), outs[i]],
                            env=env, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    errs = [p.communicate(timeout=300)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, err in zip(procs, errs):
    assert p.returncode == 0, err[-3000:]
  rng = np.random.default_rng(0)  # what process 0 sent
  reals, bools = rng.standard_normal((3, 2)), rng.random((3, 2)) < 0.5
  for out in outs:
    got = np.load(out)
    assert not got["x64"] and not got["addressable"]
    assert got["reals"].dtype == np.float64 and np.array_equal(got["reals"], reals)
    assert got["bools"].dtype == bool and np.array_equal(got["bools"], bools)
    assert got["count"].dtype == np.int32 and int(got["count"]) == 7
    np.testing.assert_array_equal(got["fetched"], np.arange(12.0).reshape(4, 3))
