"""docs/training.md "A pod run, step by step", each step run on 2 processes x 4 CPU devices
with small stand-ins: the micro model for K3, v5e:2x4 for the pod's topology, and for the
Cloud TPU environment a GKE-style one (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, with JAX's Cloud
TPU detection told it runs on a TPU VM), so that `k3jax train` joins its processes with no
--coordinator, as it does on a pod.

  1. the data: a folder of text files;
  2. the plan: `k3jax plan --analytic` prints the `k3jax train` flags (mesh, batch, remat,
     dtype) that the run then uses as printed;
  3. the per-host command: every host runs the same line;
  4. preemption: SIGTERM to one host mid-run: both save one step and exit 0;
  5. resume: the same line again, to the end;
  6. a new stage: --new-stage with a longer sequence, the step and the data continuing;
  7. export: the final weights to the official layout, which load back as that layout stores
     them (bf16, the F32 exceptions exact, the routed experts MXFP4).
"""

import json
import os
import shlex
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from convert.load import load_any
from k3jax.cli import main
from k3jax.train.metrics import read_records
from k3jax.train.step import split_model
from pallas_kernels.mxfp4.format import round_mxfp4
from tests.k3jax.train.helpers import micro_config_file

from .test_multiprocess import REPO, free_port, process_env

CLOUD_TPU_DRIVER = """
import sys
from jax._src.clusters import cloud_tpu_cluster
cloud_tpu_cluster.running_in_cloud_tpu_vm = True  # the stand-in: a TPU VM, its CPU devices
from k3jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def write_corpus(folder) -> str:
  """Step 1: a text folder (enough documents for a held-out split)."""
  os.makedirs(folder)
  rng = np.random.default_rng(0)
  words = ["model", "train", "pod", "step", "shard", "token", "layer", "expert", "the", "a"]
  for i in range(60):
    with open(os.path.join(folder, f"doc{i:03d}.txt"), "w") as f:
      f.write(" ".join(rng.choice(words, 400)) + "\n")
  return str(folder)


def plan_flags(config, capsys) -> list[str]:
  """Step 2: the flags the plan prints for the stand-in pod."""
  assert main(["plan", "--config", config, "--topology", "v5e:2x4", "--batch", "8", "--seq",
               "32", "--analytic"]) == 0
  line = next(line for line in capsys.readouterr().out.splitlines()
              if line.startswith("train with: k3jax train "))
  flags = shlex.split(line.removeprefix("train with: k3jax train "))
  flags = flags[:flags.index("--out")]  # "--out DIR --data ...": the user's to fill in
  assert "--mesh" in flags and "--batch-size" in flags
  return flags


def hosts(args: list[str], tmp_path, name: str):
  """Step 3: the same command on each of 2 hosts, in the Cloud TPU environment."""
  port = free_port()
  procs, logs = [], []
  for i in range(2):
    # JAX reads what the environment lacks of these from the TPU VM's metadata server, which
    # the stand-in has none of: the single slice's values, as a multislice JobSet sets them
    env = {**process_env(), "TPU_WORKER_HOSTNAMES": "localhost,localhost",
           "TPU_WORKER_ID": str(i), "JAX_COORDINATOR_PORT": str(port),
           "MEGASCALE_COORDINATOR_ADDRESS": "localhost", "MEGASCALE_NUM_SLICES": "1",
           "MEGASCALE_SLICE_ID": "0"}
    logs.append(str(tmp_path / f"{name}_{i}.log"))
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-c", CLOUD_TPU_DRIVER, *args], cwd=REPO,
                                    env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def read(path) -> str:
  with open(path) as f:
    return f.read()


def finish(procs, logs) -> None:
  try:
    codes = [p.wait(1500) for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert codes == [0, 0], read(logs[0])[-3000:] + read(logs[1])[-3000:]


@pytest.mark.long
def test_a_pod_run_step_by_step(tmp_path, capsys):
  config = micro_config_file(tmp_path)
  data = write_corpus(tmp_path / "corpus")
  out = str(tmp_path / "run")
  line = ["train", "--config", config, "--data", data, "--out", out, *plan_flags(config, capsys),
          "--save-every", "100", "--eval-every", "100", "--eval-batches", "1", "--no-progress",
          "--no-plots", "--compile-cache", "none"]

  procs, logs = hosts(line + ["--steps", "6"], tmp_path, "first")
  while not os.path.exists(os.path.join(out, "metrics.jsonl")) or len(read_records(out)) < 2:
    assert all(p.poll() is None for p in procs), read(logs[0])[-3000:]
    time.sleep(0.2)
  procs[0].send_signal(15)  # step 4: a preemption notice on one host
  finish(procs, logs)
  assert "process 1/2 supplies rows" in read(logs[1])  # joined by the environment alone
  stopped = {line.split(" at step ")[1].split(":")[0] for log in logs
             for line in read(log).splitlines() if "preempted" in line}
  assert len(stopped) == 1

  procs, logs = hosts(line + ["--steps", "6"], tmp_path, "resumed")  # step 5: resume
  finish(procs, logs)
  assert f"resuming from step {stopped.pop()}" in read(logs[0])

  procs, logs = hosts(line + ["--steps", "8", "--seq-len", "64", "--new-stage"], tmp_path,
                      "stage")  # step 6: a new stage
  finish(procs, logs)
  assert [r["step"] for r in read_records(out)] == list(range(1, 9))
  with open(os.path.join(out, "run.json")) as f:
    stages = json.load(f)["stages"]
  assert [(s["start_step"], s["options"]["seq_len"]) for s in stages] == [(0, 32), (6, 64)]

  hf = str(tmp_path / "hf")
  assert main(["export", os.path.join(out, "model"), hf, "--quiet"]) == 0  # step 7: export
  exported, _ = load_any(hf)
  trained, _ = load_any(os.path.join(out, "model"))
  leaves = jax.tree_util.tree_leaves_with_path
  for (path, a), (_, b) in zip(leaves(split_model(exported)[1]),
                               leaves(split_model(trained)[1]), strict=True):
    assert np.array_equal(a, as_exported(jax.tree_util.keystr(path), b)), path


def as_exported(name: str, w) -> np.ndarray:
  """A trained weight as the official layout stores it, back in float32: the routed experts
  rounded to MXFP4, the F32 exceptions (A_log, dt_bias, the short convolutions, ...) as they
  are, the rest rounded to bf16 (a weight that bf16 holds exactly counts as either)."""
  w = np.asarray(w)
  if "['experts']" in name:
    return np.asarray(round_mxfp4(jax.numpy.asarray(w)))
  rounded = w.astype(ml_dtypes.bfloat16).astype(w.dtype)
  return w if name.split("'")[-2] in F32_EXCEPTIONS else rounded


F32_EXCEPTIONS = ("A_log", "dt_bias", "k_conv", "q_conv", "v_conv", "o_norm")
