"""A new stage over prepared data (k3jax/train/stages.py): a run on one prepared dataset, then
--new-stage with a mixture that adds a second dataset (listed first) and doubles --seq-len. The
step and the optimizer state continue bit for bit; in every data shard the continuing dataset's
next documents are the ones its uninterrupted stream gives next (by document number and
tokens), the new one starts at its beginning; run.json records both stages. Without
--new-stage the change is refused in one line. Groups of about two rows (GROUP_ROWS patched)
so that a few steps hand out whole groups."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from k3jax.corpus import stream as stream_lib
from k3jax.corpus.prepared import PreparedDataset
from k3jax.errors import UserError
from k3jax.train import inputs, loop, stages
from k3jax.train.loop import run

from .helpers import micro_config_file, options
from .test_prepared_run import _prepare
from .test_stages import saved_state

SHARDS = 2


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
  """Two prepared byte datasets of short documents (40-100 bytes) and a mixture of them."""
  root = tmp_path_factory.mktemp("data")
  rng = np.random.default_rng(0)
  for name, n in (("a", 40), ("b", 30)):
    src = root / f"{name}_src"
    src.mkdir()
    for i in range(n):
      words = rng.choice(["def", "x", "return", "class", "for", "in", "(", ")"],
                         int(rng.integers(10, 20)))
      (src / f"{i:03d}.txt").write_text(f"{name}{i} " + " ".join(words))
    _prepare([src], root / name, shard_tokens=4_000)
  # the new dataset first: the continuing one changes index but keeps its stream
  (root / "mix.json").write_text(json.dumps({"components": [{"path": "b", "weight": 0.5},
                                                            {"path": "a", "weight": 0.5}]}))
  return root


def _opts(out, datasets, **kw):
  return options(out, micro_config_file(out), **{
      "steps": 3, "decay_steps": 8, "save_every": 100, "eval_every": 100,
      "data": str(datasets / "a"), "data_shards": SHARDS, "tensorboard": False,
      "plots": False, **kw})


def _uninterrupted(dataset, position: int, shard: int, n: int, seq_len: int) -> list[int]:
  """Document numbers of positions [position, position + n) of a one-dataset run's stream."""
  spec = stream_lib.StreamSpec(seq_len, 0, shard, SHARDS, 1, (1,), (0,))
  return [stream_lib.component_position(0, dataset, p, spec)
          for p in range(position, position + n)]


def test_a_new_stage_adds_a_prepared_dataset_and_continues_the_other(tmp_path, datasets,
                                                                     monkeypatch):
  monkeypatch.setattr(stream_lib, "GROUP_ROWS", 2)
  run(_opts(tmp_path, datasets))
  a, b = PreparedDataset(str(datasets / "a")), PreparedDataset(str(datasets / "b"))
  consumed = [json.loads((tmp_path / "checkpoints" / "3" / "data" / f"shard_{s}.json")
                         .read_text())["consumed"] for s in range(SHARDS)]
  assert all(c[a.fingerprint] > 0 for c in consumed)
  saved, _ = saved_state(_opts(tmp_path, datasets), 3)

  changed = _opts(tmp_path, datasets, data=None, data_mix=str(datasets / "mix.json"),
                  seq_len=64, steps=4)
  with pytest.raises(UserError, match=r"^\S+ holds a run with --data '\S+/a' \(now None\); "
                                      r"resuming must keep it: start a new stage") as refused:
    run(changed)
  assert "\n" not in str(refused.value)

  seen = {}
  initial_state, iterator = loop._initial_state, inputs.TrainingData.iterator

  def spy_state(r):
    initial_state(r)
    seen["state"] = jax.device_get(r.state)

  def spy_iterator(self, *args):
    probe = iterator(self, *args)  # the stage's first batch, read on a copy
    seen["batch"], seen["specs"] = next(probe), [probe._its[s]._spec for s in range(SHARDS)]
    probe.close()
    return iterator(self, *args)

  monkeypatch.setattr(loop, "_initial_state", spy_state)
  monkeypatch.setattr(inputs.TrainingData, "iterator", spy_iterator)
  second = run(dataclasses.replace(changed, new_stage=True))
  assert second["start_step"] == 3
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(saved))[0],
                          jax.tree.leaves(seen["state"])):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))  # bit for bit

  for s, spec in enumerate(seen["specs"]):
    docs = stream_lib.GroupSource([b, a], spec).documents(0)
    from_a = [d for c, d in docs if c == 1]
    from_b = [d for c, d in docs if c == 0]
    assert from_a and from_b
    assert from_a == _uninterrupted(a, consumed[s][a.fingerprint], s, len(from_a), 64)
    # b starts its stream at position 0 (its own seed slot, 1: a keeps 0)
    fresh = stream_lib.StreamSpec(64, 0, s, SHARDS, 1, (1,), (0,), (1,))
    assert from_b == [stream_lib.component_position(0, b, p, fresh)
                      for p in range(len(from_b))]
    # the tokens the stage trained on first: those documents, packed at 64
    want = stream_lib.pack([(a if c else b).read([d])[0] for c, d in docs], 64)["tokens"]
    rows = slice(s * 2, s * 2 + 2)
    np.testing.assert_array_equal(seen["batch"]["inputs"][0, rows], want[:2, :-1])

  with open(tmp_path / "run.json") as f:
    stages = json.load(f)["stages"]
  assert [(s["stage"], s["start_step"], s["options"]["seq_len"], s["options"]["data_mix"])
          for s in stages] == [(0, 0, 32, None), (1, 3, 64, str(datasets / "mix.json"))]
  assert stages[1]["streams"] == {a.fingerprint: 0, b.fingerprint: 1}
  assert stages[1]["data_offsets"] == {str(s): {a.fingerprint: consumed[s][a.fingerprint]}
                                       for s in range(SHARDS)}
  assert stages[1]["sources"] == {str(datasets / "a"): {
      "fingerprint": a.fingerprint,
      "documents": {str(s): consumed[s][a.fingerprint] for s in range(SHARDS)}}}


def test_prepared_starts_keep_each_continuing_components_slot():
  """Stage 0 read [x, y] (slots 0, 1); a stage of [z, y] continues y on slot 1 at each shard's
  count and starts z on the free slot 0; the next stage of [y, w] keeps y's slot 1 again."""
  state = {"0": {"consumed": {"x": 5, "y": 3}}, "1": {"consumed": {"x": 4, "y": 7}}}
  offsets, streams, sources = stages.prepared_starts(state, None, {"/z": "z", "/y": "y"}, 2)
  assert offsets == {0: {"y": 3}, 1: {"y": 7}}
  assert streams == {"y": 1, "z": 0}
  assert sources == {"/y": {"fingerprint": "y", "documents": {"0": 3, "1": 7}}}
  later = {"0": {"consumed": {"z": 2, "y": 9}}, "1": {"consumed": {"z": 1, "y": 8}}}
  offsets, streams, _ = stages.prepared_starts(later, streams, {"/y": "y", "/w": "w"}, 2)
  assert offsets == {0: {"y": 9}, 1: {"y": 8}} and streams == {"y": 1, "w": 0}
  # nothing in common (or text before): everything starts at 0
  assert stages.prepared_starts({"0": {"next_index": 4}}, None, {"/w": "w"}, 1) == (
      {}, {"w": 0}, {})
