"""Two processes x 4 CPU devices (mesh data=2,expert=2,tensor=2, float64) stopping on purpose
or not at all (docs/training.md#a-pod-run-step-by-step):

  - a SIGTERM to one process mid-run: both finish the same step, save it, print one line and
    exit 0; the same command resumes, and metrics.jsonl then equals the one-device run's
    (1e-9, timing keys left out);
  - one process stalls inside step 3: the watchdog ends both within --step-timeout, exit 75,
    each with one line naming the step;
  - ten consecutive starts over one shared compilation cache (warmed by a one-process run of
    the same model first) all finish with the one-device losses: before the fix about one
    two-process start in three hung in its first step over a warm cache
    (k3jax/run/start.py `use_compile_cache`).
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from k3jax.train.loop import run
from k3jax.train.metrics import read_records
from tests.k3jax.train.helpers import assert_records_close

from .helpers import run_options
from .test_multiprocess import REPO, cli_args, free_port, initial_model, process_env  # noqa: F401

MESH = "data=2,expert=2,tensor=2"
STALL_ENV, STALL_FILE = "K3JAX_TEST_STALL_AT_STEP", "K3JAX_TEST_STALL_FILE"
# process 1 sleeps while it fetches the batch of step N (a watched phase of the step) after
# writing a file that says when the stall began
DRIVER = f"""
import os, sys, time
from k3jax.cli import main
from k3jax.train import stepper
stall = int(os.environ.get("{STALL_ENV}", "0"))
batch, seen = stepper.next_batch, []
def stalling_batch(run, iterator):
  seen.append(1)
  if len(seen) + run.start == stall and "--process-id" in sys.argv and \\
      sys.argv[sys.argv.index("--process-id") + 1] == "1":
    with open(os.environ["{STALL_FILE}"], "w") as f:
      f.write(str(time.time()))
    time.sleep(3600)
  return batch(run, iterator)
stepper.next_batch = stalling_batch
sys.exit(main(sys.argv[1:]))
"""


def launch(args: list[str], tmp_path, name: str, env: dict | None = None):
  """Both processes of one launch, their output going to files."""
  args = args + ["--mesh", MESH, "--coordinator", f"localhost:{free_port()}",
                 "--num-processes", "2"]
  procs, logs = [], []
  for i in range(2):
    logs.append(str(tmp_path / f"{name}_{i}.log"))
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-c", DRIVER, *args, "--process-id", str(i)], cwd=REPO,
          env={**process_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def read(path) -> str:
  with open(path) as f:
    return f.read()


def finish(procs, logs, timeout=1500.0) -> list[int]:
  try:
    for p in procs:
      p.wait(timeout)
  finally:
    for p in procs:
      p.kill()
  return [p.returncode for p in procs]


def one_device_run(tmp_path_factory, initial_model, steps: int):  # noqa: F811
  out = tmp_path_factory.mktemp("one")
  run(run_options(out, None, init_from=initial_model, steps=steps, save_every=100))
  return read_records(str(out))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, initial_model):  # noqa: F811
  """The 6-step one-device run of the same model and data."""
  return one_device_run(tmp_path_factory, initial_model, 6)


# the preempted run's length: the notice takes a step or two to be agreed on, and a step of
# this model takes about 0.2 s, so a 6-step run could end before the agreed step
PREEMPTED_STEPS = 12


@pytest.fixture(scope="module")
def one_device_long(tmp_path_factory, initial_model):  # noqa: F811
  """The one-device run as long as the preempted one."""
  return one_device_run(tmp_path_factory, initial_model, PREEMPTED_STEPS)


@pytest.mark.long
def test_sigterm_to_one_process_both_save_one_step_and_resume_exactly(
    tmp_path, initial_model, one_device_long):  # noqa: F811
  out = tmp_path / "run"
  args = cli_args(run_options(out, None, init_from=initial_model, save_every=100,
                              steps=PREEMPTED_STEPS)) + [
      "--steps", str(PREEMPTED_STEPS)]
  procs, logs = launch(args, tmp_path, "first")
  t0 = time.monotonic()
  while len(read_records(str(out))) < 2 if (out / "metrics.jsonl").exists() else True:
    assert all(p.poll() is None for p in procs), read(logs[0])[-3000:]
    assert time.monotonic() - t0 < 1500
    time.sleep(0.1)
  procs[1].send_signal(15)  # SIGTERM to process 1 alone
  assert finish(procs, logs) == [0, 0], read(logs[0])[-3000:] + read(logs[1])[-3000:]
  lines = [[line for line in read(log).splitlines() if "preempted" in line] for log in logs]
  assert all(len(found) == 1 for found in lines), lines
  steps = {int(found[0].split(" at step ")[1].split(":")[0]) for found in lines}
  assert len(steps) == 1, lines  # both processes saved one and the same step
  (stopped,) = steps
  assert 2 <= stopped < PREEMPTED_STEPS
  assert sorted(os.listdir(out / "checkpoints")) == [str(stopped)]

  procs, logs = launch(args, tmp_path, "resumed")
  assert finish(procs, logs) == [0, 0], read(logs[0])[-3000:]
  assert f"resuming from step {stopped}" in read(logs[0])
  assert_records_close(read_records(str(out)), one_device_long, atol=1e-12)


@pytest.mark.long
def test_a_stalled_process_ends_both_within_the_step_timeout(tmp_path, initial_model):  # noqa: F811
  out, marker, timeout = tmp_path / "run", tmp_path / "stalled", 30
  args = cli_args(run_options(out, None, init_from=initial_model, save_every=100)) + [
      "--steps", "6", "--step-timeout", str(timeout)]
  procs, logs = launch(args, tmp_path, "stall", {STALL_ENV: "3", STALL_FILE: str(marker)})
  codes = finish(procs, logs)
  ended = time.time()
  assert codes == [75, 75], read(logs[0])[-3000:] + read(logs[1])[-3000:]
  assert ended - float(read(marker)) < timeout + 30  # both ended soon after the deadline
  # process 1 stalled in its batch; process 0 waits for step 3's collectives with it
  wants = ("step 3: waiting for its result from the devices (collectives with every process)",
           "step 3: waiting for its batch (the input pipeline, then its placement on the "
           "devices)")
  for log, want in zip(logs, wants):
    errors = [line for line in read(log).splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"k3jax train: error: {want}: not done after {timeout} s"), errors


@pytest.mark.long
def test_ten_starts_over_one_compilation_cache_all_finish(
    tmp_path, initial_model, one_device):  # noqa: F811
  cache = tmp_path / "cache"
  # a one-process run of the same model first, in a process of its own (the test process
  # writes no cache entries, tests/conftest.py): the cache is warm, as after any earlier run
  args = cli_args(run_options(tmp_path / "warm", None, init_from=initial_model, steps=6,
                              save_every=100)) + ["--steps", "6", "--compile-cache", str(cache)]
  with open(tmp_path / "warm.log", "w") as log:
    code = subprocess.run([sys.executable, "-c", DRIVER, *args], cwd=REPO, env=process_env(),
                          stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
  assert code == 0, read(tmp_path / "warm.log")[-3000:]
  assert os.listdir(cache)
  want = [r["loss"] for r in one_device]
  results = []
  for start in range(10):
    out = tmp_path / f"run{start}"
    args = cli_args(run_options(out, None, init_from=initial_model, save_every=100)) + [
        "--steps", "6", "--compile-cache", str(cache)]
    procs, logs = launch(args, tmp_path, f"start{start}")
    codes = finish(procs, logs, timeout=900)
    results.append(codes)
    assert codes == [0, 0], (start, read(logs[0])[-3000:])
    np.testing.assert_allclose([r["loss"] for r in read_records(str(out))], want, rtol=1e-9)
  print(json.dumps({"starts": len(results), "all_finished": True}))
