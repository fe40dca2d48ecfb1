"""A prepared dataset on two processes x 4 CPU devices (gloo; the set-up of
test_multiprocess.py): with --data-shards 2 each process reads only the data shard of its rows,
trains steps 1-2, saves, resumes for step 3; the losses equal a one-process run on one device
over the same data shards, and that run's checkpoint at step 3, resumed by one process on one
device for steps 4-5, continues equal. float64: the runs differ only by summation order."""

import glob
import os
import sysconfig

import numpy as np
import pytest

from k3jax.corpus.prepare import PrepareOptions, prepare
from k3jax.train.loop import run
from k3jax.train.metrics import read_records

from .helpers import run_options
from .test_multiprocess import cli_args, initial_model, run_pair

__all__ = ["initial_model"]  # the fixture, shared with test_multiprocess.py


@pytest.mark.long
def test_two_processes_on_a_prepared_dataset_resume_equal_one_process(tmp_path, initial_model):
  data = str(tmp_path / "data")
  files = sorted(glob.glob(os.path.join(sysconfig.get_path("stdlib"), "*.py")))[:60]
  prepare(PrepareOptions(sources=tuple(files), out=data, workers=0, progress=False,
                         shard_tokens=300_000))
  out = tmp_path / "two"
  logs = run_pair(cli_args(run_options(out, None, init_from=initial_model)) + [
      "--data", data, "--data-shards", "2", "--mesh", "data=2,expert=2,tensor=2"])
  for i, log in enumerate(logs):
    assert f"process {i}/2 supplies rows [{4 * i}, {4 * i + 4}) of each micro-batch from data " \
           f"shard(s) [{i}]" in log, log[-3000:]
  assert "resuming from step 2" in logs[0]

  one = run(run_options(tmp_path / "one", None, init_from=initial_model, steps=5, data=data,
                        data_shards=2))
  run(run_options(out, None, init_from=initial_model, steps=5, data=data, data_shards=2))
  got, want = read_records(str(out)), read_records(one["out"])
  assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-9)
  np.testing.assert_allclose(got[-1]["eval_loss"], want[-1]["eval_loss"], rtol=1e-9)
  # one data position per data shard, each written by the process that read it
  assert sorted(os.listdir(out / "checkpoints" / "3" / "data")) == [
      "commit_success.txt", "shard_0.json", "shard_1.json"]
