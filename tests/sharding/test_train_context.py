"""Training with the sequence split over a `context` axis (docs/sharding.md#context-parallelism,
docs/training.md): `k3jax train --mesh data=2,context=4` on a prepared dataset read as 2 data
shards (the run's own data pipeline, each process keeping its rows' positions its devices
hold) trains what one device trains: the same losses and gradient norms after 2 steps
(float64, the chunked loss cut within each device's positions), on packed rows of 256
positions whose documents cross the 4 devices' ranges; the same command on 2 processes x 4
devices with `--mesh context=4,tensor=2` (each process holding half of every row's positions,
read by its own pipeline) trains what one device trains; and
the train step on `context=2,expert=2,tensor=2` (weights split over context like fsdp, experts
over expert x context) equals the one-device step, parameters and optimizer state. A sequence
length that leaves a device part of a KDA chunk is refused in one line before anything
compiles."""

import glob
import json
import os
import sysconfig

import jax
import numpy as np
import pytest

from k3jax.cli import main
from k3jax.corpus import prepare as prepare_lib
from k3jax.train import data
from k3jax.train import step as step_lib
from k3jax.train.loop import run
from k3jax.train.metrics import read_records
from sharding.mesh import make_mesh
from tests.k3jax.train.helpers import cli_args, micro_config_file, options

from .helpers import assert_close, model_config, run_options, run_steps, step_cfg
from .test_sharded_start import CLI_DRIVER, launch

T = 256


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
  return micro_config_file(tmp_path_factory.mktemp("cfg"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """A prepared byte dataset of a few standard-library sources."""
  out = tmp_path_factory.mktemp("data") / "stdlib"
  sources = sorted(glob.glob(os.path.join(sysconfig.get_path("stdlib"), "*.py")))[:40]
  prepare_lib.prepare(prepare_lib.PrepareOptions(sources=tuple(sources), out=str(out),
                                                 workers=0, progress=False))
  return str(out)


def _options(out, config_file, **changes):
  return options(out, config_file, steps=2, decay_steps=2, warmup_steps=1, batch_size=2,
                 seq_len=T, eval_every=1000, save_every=1000, dtype="float64", loss_chunk=32,
                 qb_method="histogram", tensorboard=False, plots=False, **changes)


def _run(out, config_file, **changes):
  summary = run(_options(out, config_file, **changes))
  return summary, read_records(str(out))


@pytest.mark.long  # two float64 training runs: minutes on the 2-core CPU
def test_train_command_splits_the_sequence(tmp_path, config_file, prepared):
  _, one = _run(tmp_path / "one", config_file, data=prepared, data_shards=2)
  _, split = _run(tmp_path / "split", config_file, data=prepared, data_shards=2,
                  mesh="data=2,context=4")
  assert [r["step"] for r in split] == [1, 2]
  for a, b in zip(split, one):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-9, abs=0)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-8, abs=0)
  with open(tmp_path / "split" / "run.json") as f:
    assert json.load(f)["options"]["mesh"] == "data=2,context=4"


@pytest.mark.long  # a float64 run on one device and one on 2 processes
def test_two_processes_each_read_their_positions(tmp_path, config_file, prepared):
  _, one = _run(tmp_path / "one", config_file, data=prepared, data_shards=2)
  out = str(tmp_path / "two")
  args = cli_args(_options(out, config_file)) + [
      "--dtype", "float64", "--loss-chunk", "32", "--qb-method", "histogram", "--data",
      prepared, "--data-shards", "2", "--no-plots", "--no-tensorboard", "--compile-cache",
      "none", "--mesh", "context=4,tensor=2", "--num-processes", "2"]
  launch(CLI_DRIVER, lambda i, port: args + ["--coordinator", f"localhost:{port}",
                                             "--process-id", str(i)], tmp_path, "two")
  two = read_records(out)
  assert [r["step"] for r in two] == [1, 2]
  for a, b in zip(two, one):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-9, abs=0)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-8, abs=0)


def _packed(seed, rows=2):
  rng = np.random.default_rng(seed)
  seg = np.ones((rows, T + 1), np.int32)
  seg[0, 100:], seg[0, 130:], seg[1, 128:], seg[:, -5:] = 2, 3, 2, 0
  tokens = np.where(seg > 0, rng.integers(0, 256, (rows, T + 1)), 0)
  return data.rows_to_batch(tokens, seg, 1)


@pytest.mark.long  # the model level (test_context_parallel.py) is in the default run
def test_train_step_on_context_expert_tensor_equals_one_device():
  opts = run_options("unused", "unused", seq_len=T, batch_size=2)
  batches = [_packed(seed) for seed in range(2)]
  with jax.enable_x64(True):
    (cfg, ex), sc = model_config(opts), step_cfg(opts)
    one_device = step_lib.build(cfg, ex, sc)
    init = one_device.init_params(0)
    want, want_loss = run_steps(one_device, init, batches)
    split = step_lib.build(cfg, ex, sc, make_mesh("context=2,expert=2,tensor=2"))
    got, got_loss = run_steps(split, init, batches)
    want, got = jax.device_get(want), jax.device_get(got)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-9, atol=0)
  assert_close(got["params"], want["params"], rtol=1e-9, what="params")
  assert_close(got["opt_state"], want["opt_state"], rtol=1e-9, what="opt_state")
  assert split.shardings["params"]["moe"]["experts"]["w1"].spec[1] == ("expert", "context")


def test_sequence_not_in_whole_chunks_per_device_is_refused(tmp_path, config_file, capsys):
  args = ["train", "--out", str(tmp_path / "bad"), "--config", config_file, "--steps", "1",
          "--batch-size", "2", "--seq-len", "192", "--mesh", "data=2,context=4",
          "--no-progress"]
  assert main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "context=4 does not split a sequence of 192 positions" in err[0]
  assert not os.path.exists(tmp_path / "bad" / "checkpoints")


