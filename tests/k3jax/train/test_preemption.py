"""Stopping a run on purpose, one process (the two-process case: tests/sharding/
test_multiprocess_stops.py): a SIGTERM mid-run lets the step finish, saves it, says so in one
line and returns (exit 0); the same command resumes and its metrics equal the uninterrupted
run's (float64, 1e-9). A SIGTERM during start-up stops the run before its first step with
nothing lost. --save-every-minutes saves by the clock; 0 is refused."""

import os
import signal

import pytest

from k3jax.cli import main
from k3jax.errors import UserError
from k3jax.train import loop
from k3jax.train.loop import run
from k3jax.train.metrics import read_records

from .helpers import assert_records_close, cli_args, micro_config_file, options


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
  return micro_config_file(tmp_path_factory.mktemp("cfg"))


def f64(out, config_file, **changes):
  return options(out, config_file, **{"dtype": "float64", "steps": 6, "eval_every": 100,
                                      "save_every": 100, **changes})


def test_sigterm_mid_run_saves_that_step_and_the_run_resumes_exactly(config_file, tmp_path,
                                                                       capsys):
  straight = run(f64(tmp_path / "straight", config_file))

  # step 3's line is written while step 4 runs (metrics are read one step late): the
  # SIGTERM lands during step 4, which finishes and is saved
  def sigterm_after_step_3(step, record):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)

  out = tmp_path / "run"
  handler = signal.getsignal(signal.SIGTERM)
  stopped = run(f64(out, config_file), on_step=sigterm_after_step_3)
  assert stopped["preempted"] == 4 and stopped["checkpoints"] == [4]
  lines = [line for line in capsys.readouterr().out.splitlines() if "preempted" in line]
  assert len(lines) == 1 and lines[0].startswith(
      "k3jax train: preempted (SIGTERM) at step 4: checkpoint 4 saved in "), lines
  assert not (out / "model").exists()  # the final weights are for a finished run
  assert [r["step"] for r in read_records(str(out))] == [1, 2, 3, 4]
  assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler is gone again

  resumed = run(f64(out, config_file))
  assert resumed["start_step"] == 4 and resumed["preempted"] is None
  assert_records_close(read_records(str(out)), read_records(straight["out"]))


def test_sigterm_during_start_up_stops_before_the_first_step(config_file, tmp_path, capsys,
                                                             monkeypatch):
  out = tmp_path / "run"
  assert run(f64(out, config_file, steps=2))["checkpoints"] == [2]
  before = read_records(str(out))
  capsys.readouterr()
  load = loop._load_data

  def load_then_sigterm(r):
    os.kill(os.getpid(), signal.SIGTERM)  # while the data loads: before any step
    load(r)

  monkeypatch.setattr(loop, "_load_data", load_then_sigterm)
  args = cli_args(f64(out, config_file)) + ["--dtype", "float64", "--compile-cache", "none"]
  assert main(args) == 0
  printed = capsys.readouterr().out.strip().splitlines()
  assert printed[-1] == ("k3jax train: preempted (SIGTERM) during start-up, before step 3: "
                         "nothing new to save; run the same command again (it resumes from "
                         "checkpoint 2)")
  assert sorted(os.listdir(out / "checkpoints")) == ["2"]  # nothing lost, nothing new
  assert read_records(str(out)) == before


def test_save_every_minutes_saves_by_the_clock(config_file, tmp_path):
  # the options of the SIGTERM test's runs (one compiled step for the file)
  summary = run(f64(tmp_path, config_file, steps=3, keep=5,
                    save_every_minutes=1e-9))  # due after every step
  assert summary["checkpoints"] == [1, 2, 3]


def test_save_every_minutes_must_be_positive(config_file, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:  # argparse: one line naming the flag, exit 2
    main(cli_args(options(tmp_path, config_file)) + ["--save-every-minutes", "0"])
  assert e.value.code == 2
  assert "argument --save-every-minutes: must be > 0, got 0" in capsys.readouterr().err
  with pytest.raises(UserError, match="--save-every-minutes must be > 0, got 0"):
    run(options(tmp_path, config_file, save_every_minutes=0))
  assert os.listdir(tmp_path) == []  # refused before anything was written
