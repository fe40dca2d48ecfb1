"""Whole runs of `k3jax train` on the micro model: the loss falls; outputs (metrics.jsonl,
TensorBoard, plots, the final model) are written; stop-and-resume and a SIGKILL during a
checkpoint save both reproduce the straight run; fine-tuning starts from the given weights; user
mistakes exit 2 with one line.

Every in-process run shares one StepConfig and batch shape, so the train step compiles once
per test process; the subprocess runs reuse it through the test run's persistent compilation
cache (tests/conftest.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from k3jax.cli import main
from k3jax.folders import MODEL_DIR
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import checkpoint as ckpt_lib
from k3jax.train import data as data_lib
from k3jax.train import flops
from k3jax.train import step as step_lib
from k3jax.train.loop import execution, run, step_config
from k3jax.train.metrics import read_records

from .helpers import MICRO, STEPS, cli_args, micro_config_file, options

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
  return micro_config_file(tmp_path_factory.mktemp("cfg"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, config_file):
  out = tmp_path_factory.mktemp("straight")
  summary = run(options(out, config_file))
  return summary, read_records(str(out))


def losses(records):
  return {r["step"]: r["loss"] for r in records}


def test_loss_falls_and_outputs_are_written(straight):
  summary, records = straight
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  loss = [r["loss"] for r in records]
  assert np.log(256) - 0.5 < np.mean(loss[:3]) < np.log(256) + 1.0  # starts near uniform
  assert np.mean(loss[-4:]) < np.mean(loss[:4]) - 1.0                # and clearly learns
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 2 and evals[1] < evals[0] < np.log(256)       # held-out loss falls
  n_moe, n_exp = len(MICRO.moe_layers), MICRO.num_experts
  train_flops_per_token = flops.count(MICRO, 32).train_per_token   # options(): seq_len 32
  for r in records:
    assert r["grad_norm"] > 0 and r["lr"] > 0 and r["loss_tokens"] > 0
    for key in ("load_max_mean_before", "load_max_mean_after"):
      # the busiest expert's load over the mean: 1 when balanced, E when one takes every pair
      # (fp32 quotient: one rounding, 1e-6 relative)
      assert len(r[key]) == n_moe and all(
          1 - 1e-6 <= v <= n_exp * (1 + 1e-6) for v in r[key]), key
    for key in ("dead_before", "dead_after"):
      # the fraction of experts that got no pair: a multiple of 1/E, below 1
      assert len(r[key]) == n_moe and all(
          0 <= v < 1 and abs(v * n_exp - round(v * n_exp)) < 1e-6 for v in r[key]), key
    if r["step"] > 1:  # the first step of a process includes compilation
      # MFU is the model FLOPs of the tokens/s it reports over the peak given (1 TFLOP/s)
      assert r["mfu"] == pytest.approx(train_flops_per_token * r["tokens_per_s"] / 1e12,
                                       rel=1e-12)
  out = summary["out"]
  for name in ("loss.png", "expert_load.png"):
    with open(os.path.join(out, "plots", name), "rb") as f:
      png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(out, "tb")))
  assert summary["checkpoints"] == [12, 24]
  with open(os.path.join(out, "model", ckpt_lib.MODEL_CONFIG)) as f:
    assert json.load(f)["config"] == MICRO.to_dict()


def test_stop_and_resume_equals_the_straight_run(straight, tmp_path, config_file):
  _, want = straight
  first = run(options(tmp_path, config_file, steps=12))
  assert first["checkpoints"] == [12]
  second = run(options(tmp_path, config_file))
  assert second["start_step"] == 12 and second["checkpoints"] == [12, 24]
  got = read_records(str(tmp_path))
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a["loss"], b["loss"], atol=1e-5, rtol=0, err_msg=a["step"])
    np.testing.assert_allclose(a["load_max_mean_after"], b["load_max_mean_after"], atol=1e-5)
  assert [r.get("eval_loss") for r in got][11::12] == pytest.approx(
      [r.get("eval_loss") for r in want][11::12], abs=1e-5)


def _trainer(args, env):
  return subprocess.Popen([sys.executable, "-m", "k3jax.cli", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.long
def test_sigkill_during_a_save_resumes_from_the_last_complete_checkpoint(
    straight, tmp_path, config_file):
  _, want = straight
  out = tmp_path / "run"
  args = cli_args(options(out, config_file, save_every=4))  # the run's compile cache (conftest)
  env = {**os.environ, ckpt_lib.SAVE_DELAY_ENV: "8"}  # the kill lands in save 8's 8 s hold
  events = tmp_path / "run" / ckpt_lib.SAVE_EVENTS
  proc = _trainer(args, env)
  # save 4 commits slowly; save 8 waits for it, then starts: kill while save 8 is in flight
  deadline = time.time() + 1500
  while not (events.exists() and len(events.read_text().splitlines()) >= 2):
    assert proc.poll() is None, proc.stdout.read()
    assert time.time() < deadline, "the trainer never reached its second save"
    time.sleep(0.05)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  checkpoints = out / "checkpoints"
  in_flight = os.path.relpath(events.read_text().splitlines()[1], checkpoints).split(os.sep)[0]
  assert in_flight.startswith("8.") and in_flight.endswith("tmp")  # step 8, not committed
  assert sorted(os.listdir(checkpoints)) == sorted(["4", in_flight])
  killed = losses(read_records(str(out)))
  assert max(killed) >= 8  # the killed run had trained past the checkpoint it resumes from

  env.pop(ckpt_lib.SAVE_DELAY_ENV)
  done = subprocess.run([sys.executable, "-m", "k3jax.cli", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=1500)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "resuming from step 4" in done.stdout
  assert sorted(os.listdir(checkpoints)) == ["16", "20", "24"]  # keep 3; the partial is gone
  got = read_records(str(out))
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a["loss"], b["loss"], atol=1e-5, rtol=0, err_msg=a["step"])
  for s in range(5, 9):  # what the killed run computed after its last checkpoint, again
    np.testing.assert_allclose(losses(got)[s], killed[s], atol=1e-5, rtol=0)


def _first_batch_loss(folder, config_file, tmp_path, weights=None):
  """Train one step from `folder`; return (the step's loss, the loss of the folder's weights
  (or of those in `weights`) on that same first batch computed directly)."""
  out = tmp_path / os.path.basename(folder)
  opts = options(out, None, init_from=str(folder), steps=1)
  summary = run(opts)
  from convert.load import load_any
  model, _ = load_any(str(weights or folder))
  _, params, bias = step_lib.split_model(model)
  steps = step_lib.build(MICRO, execution(opts), step_config(opts))
  docs = data_lib.split_documents(data_lib.stdlib_documents())[0]
  tokens = data_lib.tokenize(docs, ByteTokenizer())
  pipe = data_lib.PipelineConfig(opts.seq_len, opts.batch_size, opts.grad_accum, opts.seed)
  it = data_lib.iterate(data_lib.train_dataset(tokens, pipe))
  batch = jax.tree.map(lambda x: x[0], next(it))
  it.close()
  params, bias = step_lib.place((params, bias))
  nll, _, _ = steps.forward(params, bias, batch["inputs"], batch["targets"],
                            batch["segment_ids"], batch["loss_mask"])
  return summary["first_loss"], float(np.sum(nll) / batch["loss_mask"].sum())


def test_fine_tune_from_a_checkpoint_and_from_an_official_folder(straight, tmp_path,
                                                                 config_file):
  """--init-from the straight run's final model (a k3jax model checkpoint) and from its export
  to the official layout: training starts from exactly those weights."""
  summary, _ = straight
  model_dir = os.path.join(summary["out"], MODEL_DIR)
  hf_dir = tmp_path / "hf"
  assert main(["export", model_dir, str(hf_dir), "--quiet"]) == 0
  for folder in (model_dir, hf_dir):
    got, want = _first_batch_loss(folder, config_file, tmp_path)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert got < np.log(256) - 1.0  # a trained model, not a fresh one


def test_fine_tune_from_a_train_output_by_a_relative_path(straight, tmp_path, config_file,
                                                          monkeypatch):
  """--init-from a `k3jax train` output folder (its model/ and its tokenizer) by a path
  relative to the working directory: training starts from that model, and the run records
  the path absolute (a later command may run elsewhere)."""
  summary, _ = straight
  monkeypatch.chdir(os.path.dirname(summary["out"]))
  name = os.path.basename(summary["out"])
  got, want = _first_batch_loss(name, config_file, tmp_path,
                                weights=os.path.join(summary["out"], MODEL_DIR))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  with open(tmp_path / name / "run.json") as f:
    assert json.load(f)["options"]["init_from"] == summary["out"]


def _cli_error(capsys, *args):
  code = main(["train", *args, "--compile-cache", "none"])
  err = capsys.readouterr().err
  return code, err


def test_user_mistakes_exit_2_with_one_line(straight, capsys, tmp_path, config_file):
  summary, _ = straight
  cases = [
      (["--out", str(tmp_path / "a"), "--config", "tiny", "--init-from", str(tmp_path)],
       "exclusive"),
      (["--out", str(tmp_path / "b"), "--init-from", str(tmp_path / "missing")], "no such"),
      (["--out", summary["out"], "--config", config_file, "--seq-len", "64"], "--seq-len"),
      (["--out", summary["out"], "--config", "tiny"], "another model config"),
      (["--out", str(tmp_path / "c"), "--config", config_file, "--batch-size", "6",
        "--grad-accum", "4"], "multiple"),
  ]
  for args, needle in cases:
    code, err = _cli_error(capsys, *args)
    assert code == 2, (args, err)
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
