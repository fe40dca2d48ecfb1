"""A new stage (--new-stage, k3jax/train/stages.py): 64 -> 128 tokens per row continues with the
parameters, the optimizer state and the step bit for bit, the schedule where it was, and the
data at the same position of its stream; run.json records both stages. Refused in one line:
a stage key changed without --new-stage, --new-stage with nothing changed or nothing to
continue. (Over prepared data: test_stages_prepared.py.)"""

import json
import os

import jax
import numpy as np
import pytest

from k3jax.errors import UserError
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import data as data_lib
from k3jax.train import loop
from k3jax.train import step as step_lib
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.loop import run
from k3jax.train.metrics import read_records

from .helpers import MICRO, micro_config_file, options


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
  return micro_config_file(tmp_path_factory.mktemp("cfg"))


def stage_options(out, config_file, **changes):
  return options(out, config_file, **{"seq_len": 64, "steps": 4, "decay_steps": 8,
                                      "save_every": 100, "eval_every": 100, **changes})


def saved_state(opts, step: int):
  """(train state, data state) of checkpoint `step` of the micro-model run `opts`, restored
  on their own (not through the run's resume)."""
  steps = step_lib.build(MICRO, loop.execution(opts), loop.step_config(opts))
  params, bias = jax.eval_shape(lambda: step_lib.init_params(MICRO, loop.execution(opts), 0))
  ckpt = Checkpointer(os.path.join(opts.out, "checkpoints"), keep=3, async_save=False)
  saved, data_state, _ = ckpt.restore(step, step_lib.abstract_state(steps, params, bias))
  ckpt.close()
  return saved, data_state


def test_a_new_stage_keeps_the_optimizer_state_and_continues_the_data(config_file, tmp_path,
                                                                      monkeypatch):
  first = run(stage_options(tmp_path, config_file))
  assert first["checkpoints"] == [4]
  # the state checkpoint 4 holds, read on its own
  saved, data_state = saved_state(stage_options(tmp_path, config_file), 4)

  started = {}
  initial_state = loop._initial_state

  def spy(r):
    initial_state(r)
    started["state"] = jax.device_get(r.state)
    started["offsets"] = dict(r.data_offsets)

  monkeypatch.setattr(loop, "_initial_state", spy)
  second = run(stage_options(tmp_path, config_file, seq_len=128, steps=6, new_stage=True))
  assert second["start_step"] == 4
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(saved))[0],
                          jax.tree.leaves(started["state"])):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))  # bit for bit
  records = read_records(str(tmp_path))
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  sc = loop.step_config(stage_options(tmp_path, config_file, steps=6))
  lr = step_lib.lr_schedule(sc, sc.learning_rate)
  assert records[4]["lr"] == pytest.approx(float(lr(4)), rel=1e-6)  # no warm-up again

  with open(tmp_path / "run.json") as f:
    stages = json.load(f)["stages"]
  assert [(s["stage"], s["start_step"], s["options"]["seq_len"]) for s in stages] == [
      (0, 0, 64), (1, 4, 128)]
  # the data: the same position of the stream in epochs, whatever the piece length
  tokens = data_lib.tokenize(data_lib.split_documents(data_lib.stdlib_documents())[0],
                             ByteTokenizer())
  pieces = {t: len(data_lib.shard_pieces(tokens, data_lib.PipelineConfig(t, 4, 1, 0), 0))
            for t in (64, 128)}
  epochs = data_lib.consumed_pieces(data_state["0"]) / pieces[64]
  assert stages[1]["sources"] == {"<stdlib>": {"0": pytest.approx(epochs)}}
  assert started["offsets"] == {0: round(epochs * pieces[128])} and epochs > 0


def test_stage_changes_are_refused_in_one_line(config_file, tmp_path):
  with pytest.raises(UserError, match="--new-stage: .* holds no run to continue"):
    run(stage_options(tmp_path / "none", config_file, new_stage=True))
  run(stage_options(tmp_path, config_file, steps=2))
  with pytest.raises(UserError, match=r"holds a run with --seq-len 64 \(now 128\); resuming "
                                      r"must keep it: start a new stage with --new-stage"):
    run(stage_options(tmp_path, config_file, seq_len=128, steps=3))
  with pytest.raises(UserError, match="--new-stage: nothing differs from the stage"):
    run(stage_options(tmp_path, config_file, steps=3, new_stage=True))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # nothing lost
