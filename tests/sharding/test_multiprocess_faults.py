"""SIGKILL in a two-process run (2 processes x 4 CPU devices, mesh data=2,expert=2,tensor=2,
float64, 6 steps, a checkpoint every 2), then a restart of both, as a launcher would:

  A  process 1 hangs after its step-3 record (a test-only patch in the driver); process 0
     goes on into step 4's collectives. Once metrics.jsonl shows step 3 and checkpoint 2 is
     committed, process 1 is SIGKILLed during the step, then process 0.
  B  both restarted with K3JAX_TEST_SAVE_DELAY (checkpoint.py): they resume from step 2, and
     the step-4 save holds its commit open; once save_events.log shows it in flight, both are
     SIGKILLed: checkpoint 4 is left half-written.
  C  both restarted plainly: the half-written folder is named and removed, the run resumes
     from checkpoint 2 again and finishes.

The losses B recomputed (steps 3 on, the fault during a step) and C's (the fault during a
save) equal a one-device run's to 1e-9, and nothing else in the run directory is lost:
metrics.jsonl keeps steps 1-2 as first written, each step once; run.json stays (but for the
coordinator's port); every launch's TensorBoard file stays. One test, so the three launches
share one reference run."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from k3jax.train.checkpoint import SAVE_DELAY_ENV, SAVE_EVENTS
from k3jax.train.loop import run
from k3jax.train.metrics import read_records

from .helpers import run_options
from .test_multiprocess import REPO, cli_args, free_port, initial_model, process_env  # noqa: F401

HANG_ENV = "K3JAX_TEST_HANG_AFTER_STEP"
# process 1 writes no metrics (loop._NoWriter) but is handed every record: sleeping there
# stops it after a step while process 0 enters the next one's collectives
DRIVER = f"""
import os, sys, time
from k3jax.cli import main
from k3jax.train import loop
hang = int(os.environ.get("{HANG_ENV}", "0"))
def write(self, record):
  if record["step"] == hang:
    time.sleep(3600)
loop._NoWriter.write = write
sys.exit(main(sys.argv[1:]))
"""
STEPS = 6


def launch(out, init, tmp_path, name: str, extra_env: dict) -> tuple[list, list[str]]:
  """Both processes of one launch from the model `init`, their output going to files."""
  args = cli_args(run_options(out, None, init_from=init)) + [
      "--steps", str(STEPS), "--mesh", "data=2,expert=2,tensor=2",
      "--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
  env = {**process_env(), **extra_env}
  procs, logs = [], []
  for i in range(2):
    logs.append(str(tmp_path / f"{name}_{i}.log"))
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-c", DRIVER, *args, "--process-id", str(i)], cwd=REPO, env=env,
          stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def read(path: str) -> str:
  with open(path) as f:
    return f.read()


def wait_for(condition, procs, logs, timeout=1200.0) -> None:
  t0 = time.monotonic()
  while not condition():
    for p, log in zip(procs, logs):
      assert p.poll() is None, f"a process ended early (rc {p.returncode}):\n{read(log)[-3000:]}"
    assert time.monotonic() - t0 < timeout, read(logs[0])[-3000:]
    time.sleep(0.2)


def kill(procs) -> None:
  """SIGKILL process 1, then process 0 (left blocked in a collective or a save)."""
  for p in reversed(procs):
    p.send_signal(signal.SIGKILL)
    p.wait()


def steps_of(out) -> list[int]:
  return [r["step"] for r in read_records(str(out))]


@pytest.mark.long
def test_sigkill_during_step_and_during_save_resume_exactly(tmp_path, initial_model):  # noqa: F811
  out = tmp_path / "run"
  ckpts = out / "checkpoints"

  # A: a kill during step 4, checkpoint 2 committed
  procs, logs = launch(out, initial_model, tmp_path, "a", {HANG_ENV: "3"})
  try:
    wait_for(lambda: 3 in steps_of(out) and (ckpts / "2").is_dir(), procs, logs)
    time.sleep(2)  # process 0 is inside step 4 (its first collective waits for process 1)
  finally:
    kill(procs)
  first = read_records(str(out))
  assert [r["step"] for r in first] == [1, 2, 3]
  run_file = read(out / "run.json")
  listing = sorted(os.listdir(out))

  # B: resumed from 2, killed while the step-4 save is held open
  events = out / SAVE_EVENTS
  procs, logs = launch(out, initial_model, tmp_path, "b", {SAVE_DELAY_ENV: "3600"})
  try:
    # the commit is held in the background while the loop goes on: step 4's record (written
    # once its save has started) comes soon after the event, and step 6's save then waits
    wait_for(lambda: events.exists() and re.search(r"/4\.orbax-checkpoint-tmp", read(events))
             and 4 in steps_of(out), procs, logs)
  finally:
    kill(procs)
  assert "resuming from step 2" in read(logs[0]), read(logs[0])[-3000:]
  assert not (ckpts / "4").exists()
  second = read_records(str(out))
  assert [r["step"] for r in second] == list(range(1, len(second) + 1))
  assert second[:2] == first[:2] and len(second) >= 4  # recomputed: 3 and 4 at least

  # C: the half-written checkpoint 4 named and removed, resumed from 2 again, to the end
  procs, logs = launch(out, initial_model, tmp_path, "c", {})
  try:
    for p in procs:
      p.wait(timeout=1500)
  finally:
    kill(procs)
  log = read(logs[0])
  assert [p.returncode for p in procs] == [0, 0], log[-3000:] + read(logs[1])[-3000:]
  assert re.search(r"checkpoints/4\.orbax-checkpoint-tmp\S*: a checkpoint left half-written",
                   log), log[-3000:]
  assert "resuming from step 2" in log, log[-3000:]
  assert not [n for n in os.listdir(ckpts) if "tmp" in n]
  assert sorted(int(n) for n in os.listdir(ckpts)) == [2, 4, 6]

  # nothing else lost: metrics' first lines as written, once; run.json; every TensorBoard file
  final = read_records(str(out))
  assert [r["step"] for r in final] == list(range(1, STEPS + 1))
  assert final[:2] == first[:2]
  # rewritten by every launch: the same but for the coordinator's (free) port
  now = json.loads(read(out / "run.json"))
  was = json.loads(run_file)
  assert now["options"].pop("coordinator") != was["options"].pop("coordinator")
  assert now == was
  assert set(listing) <= set(os.listdir(out))
  tb = [f for f in os.listdir(out / "tb") if f.startswith("events.out.tfevents")]
  assert len(tb) == 3  # one per launch, from process 0

  # the trajectories equal one device's, uninterrupted
  one = read_records(run(run_options(tmp_path / "one", None, init_from=initial_model,
                                     steps=STEPS))["out"])
  want = {r["step"]: r["loss"] for r in one}
  for records, what in ((second[2:], "resumed after a kill in a step"),
                        (final, "resumed after a kill in a save")):
    got = np.array([r["loss"] for r in records])
    ref = np.array([want[r["step"]] for r in records])
    print(f"{what}: steps {records[0]['step']}-{records[-1]['step']}, max relative loss "
          f"difference {np.max(np.abs(got / ref - 1)):.2e}")
    np.testing.assert_allclose(got, ref, rtol=1e-9, err_msg=what)
  np.testing.assert_allclose(final[-1]["eval_loss"], one[-1]["eval_loss"], rtol=1e-9)
