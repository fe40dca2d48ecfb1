"""The watchdog (k3jax/run/watchdog.py): a phase that overruns its deadline ends the process
with one line naming it and exit 75; phases done in time, or nested inside a longer one, do
not; the deadlines derived from the measured steps."""

import threading
import time

import pytest

from k3jax.run import watchdog as wd


class Exits:
  """A stand-in for os._exit that records the status (the thread then returns)."""

  def __init__(self):
    self.codes, self.done = [], threading.Event()

  def __call__(self, code):
    self.codes.append(code)
    self.done.set()


def test_an_overrunning_phase_ends_the_process_with_one_line(capsys):
  exits = Exits()
  dog = wd.Watchdog("train", exit_fn=exits)
  t0 = time.monotonic()
  with dog.phase("step 3: waiting for its result from the devices", 0.3):
    assert exits.done.wait(10)
  elapsed = time.monotonic() - t0
  dog.close()
  assert exits.codes == [wd.EXIT_STALLED] == [75]
  assert 0.3 <= elapsed < 5
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("k3jax train: error: step 3: waiting for its result from the "
                         "devices: not done after 0 s")
  assert "exit 75" in line and "resume" in line


def test_phases_done_in_time_and_nested_ones_do_not_fire(capsys):
  exits = Exits()
  dog = wd.Watchdog("train", exit_fn=exits)
  for _ in range(20):
    with dog.phase("a step", 0.5):
      time.sleep(0.01)
  with dog.phase("step 1", 5.0):
    with dog.phase("start-up: the barrier", 0.5):
      time.sleep(0.05)
    time.sleep(0.8)  # past the inner phase's deadline: it is gone, the outer one holds
  with dog.phase("unwatched", None):
    time.sleep(0.6)
  dog.close()
  assert exits.codes == [] and capsys.readouterr().err == ""


def test_the_innermost_overrun_is_the_one_named(capsys):
  exits = Exits()
  dog = wd.Watchdog("train", exit_fn=exits)
  with dog.phase("step 1", 60.0):
    with dog.phase("start-up: waiting at the barrier", 0.2):
      assert exits.done.wait(10)
  dog.close()
  assert "start-up: waiting at the barrier: not done" in capsys.readouterr().err


def test_deadlines_from_the_measured_steps():
  d = wd.Deadlines(startup_s=3600.0)
  assert d.step() == 3600.0  # nothing measured yet: the start-up's
  d.measured(2.0)
  d.measured(50.0)
  assert d.step() == pytest.approx(wd.FACTOR * 50.0)
  assert d.eval(4) == pytest.approx(4 * wd.FACTOR * 50.0)
  assert d.save() == pytest.approx(max(wd.SAVE_FLOOR_S, wd.FACTOR * 50.0))
  for _ in range(30):  # the window forgets the slow step
    d.measured(1.0)
  assert d.step() == wd.FLOOR_S and d.save() == wd.SAVE_FLOOR_S
  fixed = wd.Deadlines(startup_s=3600.0, step_s=20.0)  # --step-timeout
  assert fixed.step() == fixed.save() == 20.0 and fixed.eval(2) == 40.0
