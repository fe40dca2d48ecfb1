"""Two processes x 4 CPU devices through `jax.distributed` on localhost (gloo collectives)
train on one mesh (data=2 across the processes, expert=2, tensor=2), save, resume, and
finish equal to a one-process run on one device with the default single data pipeline (the
global batch does not depend on the process count; docs/sharding.md). The two-process run's
step-3 checkpoint is then resumed by one process on one device for steps 4-5, equal again.

Both runs start `--init-from` one saved initial model (the processes restore it straight into
their shards; no process compiles a random init). Each process runs `k3jax train` twice in one
interpreter (steps 1-2 with a checkpoint at 2, then 3 resumed from it), so the resume goes
through Orbax's multi-process restore but not through a second compile. float64: the runs
differ only by float64 summation order (helpers.RTOL_F64)."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from k3jax.train import step as step_lib
from k3jax.train.checkpoint import Checkpointer, save_model
from k3jax.train.loop import run
from k3jax.train.metrics import read_records

from .helpers import assert_close, model_config, run_options, step_cfg

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
DRIVER = """
import sys
from k3jax.cli import main
args = sys.argv[1:]
assert main(args + ["--steps", "2"]) == 0
assert main(args + ["--steps", "3"]) == 0
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def cli_args(opts) -> list[str]:
  return ["train", "--out", opts.out, "--init-from", opts.init_from, "--decay-steps",
          str(opts.decay_steps), "--batch-size", str(opts.batch_size), "--seq-len",
          str(opts.seq_len), "--lr", str(opts.learning_rate), "--warmup", str(opts.warmup_steps),
          "--eval-every", str(opts.eval_every), "--eval-batches", str(opts.eval_batches),
          "--save-every", str(opts.save_every), "--peak-tflops", str(opts.peak_tflops),
          "--dtype", opts.dtype, "--qb-method", opts.qb_method, "--no-progress", "--no-plots",
          "--compile-cache", "none"]


def run_pair(args: list[str]) -> list[str]:
  """DRIVER on 2 processes with `args` (and a fresh coordinator port): the output of each,
  both having exited 0."""
  args = args + ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
  procs = [subprocess.Popen([sys.executable, "-c", DRIVER, *args, "--process-id", str(i)],
                            cwd=REPO, env=process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=1500)[0])
  finally:
    for p in procs:
      p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  return logs


def process_env() -> dict:
  """The environment of a spawned process: 4 devices; any other XLA flag as in this process,
  whose one-process run the two are compared with bit-near (an optimisation level changes
  float32 bits)."""
  flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
  return {**os.environ, "XLA_FLAGS": flags + " --xla_force_host_platform_device_count=4",
          "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory):
  """The float64 initial model every run here starts from (the one-device init of
  test_train_mesh.py: the same compiled program), saved as `k3jax train` saves models."""
  path = str(tmp_path_factory.mktemp("init") / "model")
  opts = run_options("unused", None)
  with jax.enable_x64(True):
    cfg, ex = model_config(opts)
    steps = step_lib.build(cfg, ex, step_cfg(opts))
    params, bias = steps.init_params(0)
    save_model(path, steps.graphdef, params, bias, cfg)
  return path


@pytest.mark.long
def test_two_processes_train_save_resume_equal_one_process(tmp_path, initial_model):
  out = tmp_path / "two"
  logs = run_pair(cli_args(run_options(out, None, init_from=initial_model)) + [
      "--mesh", "data=2,expert=2,tensor=2"])
  for i, log in enumerate(logs):
    # both read the one pipeline, each keeping the rows its devices hold
    assert f"process {i}/2 supplies rows [{4 * i}, {4 * i + 4}) of each micro-batch from data " \
           f"shard(s) [0]" in log, log[-3000:]
  assert "resuming from step 2" in logs[0]

  # the one-process reference: one device, the default (one data pipeline), 5 steps
  one = run(run_options(tmp_path / "one", None, init_from=initial_model, steps=5))
  # the two-process run resumed by one process on one device (steps 4-5, saved at 3)
  run(run_options(out, None, init_from=initial_model, steps=5))

  got, want = read_records(str(out)), read_records(one["out"])
  assert [r["step"] for r in got] == [1, 2, 3, 4, 5]  # process 0 alone wrote steps 1-3
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-9)
  np.testing.assert_allclose(got[-1]["eval_loss"], want[-1]["eval_loss"], rtol=1e-9)
  events = [f for f in os.listdir(out / "tb") if f.startswith("events.out.tfevents")]
  assert len(events) == 2  # one per CLI run, from process 0 only (the resume here: none)
  # one data position for the one pipeline, whatever the process count
  assert sorted(os.listdir(out / "checkpoints" / "3" / "data")) == [
      "commit_success.txt", "shard_0.json"]

  # the last checkpoints (params, router biases, optimizer state), both read on one device
  opts = run_options(out, None)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with jax.enable_x64(True):
    steps = step_lib.build(*model_config(opts), step_cfg(opts))
    params, bias = jax.eval_shape(lambda: step_lib.init_params(*model_config(opts), 0))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          step_lib.abstract_state(steps, params, bias))
    states = []
    for run_dir in (str(out), one["out"]):
      ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=3, async_save=False)
      states.append(jax.device_get(ckpt.restore(5, target)[0]))
      ckpt.close()
  assert_close(states[0], states[1], rtol=1e-9, what="step 5 state ")
