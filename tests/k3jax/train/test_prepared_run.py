"""`k3jax train` on prepared datasets and mixtures: a stopped and resumed run (under another
--data-workers) equals the straight one; processes read disjoint documents whose batches add up
to the one-process batch; the refusals (a manifest that does not match its shards, another
tokenizer's dataset, a bad mixture, a dataset prepared again or a mixture edited under a
resume) each in one line, exit 2; text documents end with the end-of-document id from data
format version 2 on, and a run that started before keeps version 1."""

import glob
import json
import os
import re
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from k3jax.cli import main
from k3jax.corpus import prepare as prepare_lib
from k3jax.errors import UserError
from k3jax.folders import RUN_FILE
from k3jax.tokenizer import ByteTokenizer, load_tokenizer
from k3jax.train import data as data_lib
from k3jax.train import inputs
from k3jax.train.loop import run
from k3jax.train.metrics import read_records
from tests.k3jax.corpus.helpers import EOS_ID, tiny_bpe

from .helpers import cli_args, micro_config_file, options

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
STDLIB = sorted(glob.glob(os.path.join(sysconfig.get_path("stdlib"), "*.py")))


def _prepare(sources, out, **kw):
  return prepare_lib.prepare(prepare_lib.PrepareOptions(
      sources=tuple(map(str, sources)), out=str(out), workers=0, progress=False, **kw))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
  """Two prepared byte datasets of standard-library sources and a mixture of them."""
  root = tmp_path_factory.mktemp("data")
  _prepare(STDLIB[:40], root / "a", shard_tokens=200_000)
  _prepare(STDLIB[40:100], root / "b", shard_tokens=300_000)
  mix = root / "mix.json"
  mix.write_text(json.dumps({"components": [{"path": "a", "weight": 0.7},
                                            {"path": "b", "weight": 0.3}]}))
  return root


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
  return micro_config_file(tmp_path_factory.mktemp("cfg"))


def _opts(out, config_file, datasets, **kw):
  return options(out, config_file, **{
      "steps": 8, "decay_steps": 8, "save_every": 4, "eval_every": 4,
      "data_mix": str(datasets / "mix.json"), "data_shards": 2, "tensorboard": False,
      "plots": False, **kw})


@pytest.fixture(scope="module")
def straight(tmp_path_factory, config_file, datasets):
  out = tmp_path_factory.mktemp("straight")
  summary = run(_opts(out, config_file, datasets))
  return summary, read_records(str(out))


def test_stop_and_resume_under_another_worker_count_equals_the_straight_run(
    straight, tmp_path, config_file, datasets):
  summary, want = straight
  assert [c["weight"] for c in summary["data"]["components"]] == [0.7, 0.3]
  run(_opts(tmp_path, config_file, datasets, steps=4))
  second = run(_opts(tmp_path, config_file, datasets, data_workers=1))  # not a resume key
  assert second["start_step"] == 4
  got = read_records(str(tmp_path))
  assert [r["step"] for r in got] == list(range(1, 9))
  # the same program on the same batches from the same restored state: bit for bit
  assert [r["loss"] for r in got] == [r["loss"] for r in want]
  assert [r.get("eval_loss") for r in got] == [r.get("eval_loss") for r in want]
  with open(tmp_path / RUN_FILE) as f:
    recorded = json.load(f)["data"]
  assert recorded["data_version"] == inputs.DATA_VERSION and recorded["mix_hash"]
  assert sorted(recorded["manifests"]) == [str(datasets / "a"), str(datasets / "b")]
  state = json.loads((tmp_path / "checkpoints" / "8" / "data" / "shard_1.json").read_text())
  assert set(state) == {"group", "row", "offsets", "consumed"}


DRIVER = """
import json, sys
import numpy as np
from k3jax.corpus import mixture
from k3jax.corpus.prepared import PreparedDataset
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import data, inputs

folder, start, stop, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
read = []
original = PreparedDataset.read
def logged(self, indices):
  read.extend(int(i) for i in indices)
  return original(self, indices)
PreparedDataset.read = logged
cfg = data.PipelineConfig(seq_len=32, batch_rows=8, micro_batches=2, seed=1, num_shards=2)
training = inputs.load_training_data(None, "text", ByteTokenizer(), cfg, 1,
                                     mix=mixture.single(folder))
read.clear()  # the held-out documents every process reads for eval
it = training.iterator(cfg, (start, stop))
batches = [next(it) for _ in range(3)]
it.close()
np.savez(out, read=np.asarray(read), **{f"{k}{i}": b[k] for i, b in enumerate(batches)
                                          for k in b})
"""


def test_two_processes_read_disjoint_documents_whose_rows_add_up(tmp_path, datasets):
  """Two OS processes, each reading the rows of one data shard of 2 (rows [0, 2) and [2, 4)
  of each 4-row micro-batch), read disjoint documents, and their rows side by side are the
  global batch one process reads."""
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  runs = {"two0": (0, 2), "two1": (2, 4), "one": (0, 4)}
  procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(datasets / "b"), str(lo),
                             str(hi), str(tmp_path / f"{name}.npz")], env=env, cwd=REPO)
           for name, (lo, hi) in runs.items()]
  for p in procs:
    assert p.wait(timeout=600) == 0
  p0, p1, one = (np.load(tmp_path / f"{name}.npz") for name in runs)
  assert len(p0["read"]) and len(p1["read"])
  assert not set(p0["read"].tolist()) & set(p1["read"].tolist())
  for key in ("inputs", "targets", "segment_ids", "loss_mask"):
    for i in range(3):
      np.testing.assert_array_equal(
          np.concatenate([p0[f"{key}{i}"], p1[f"{key}{i}"]], axis=1), one[f"{key}{i}"])


def test_refusals_exit_2_in_one_line_writing_nothing(tmp_path, config_file, datasets,
                                                     capsys):
  bpe = tiny_bpe(tmp_path / "bpe")
  (tmp_path / "doc.txt").write_text("def x def x")
  _prepare([tmp_path / "doc.txt"], tmp_path / "bpe_data", tokenizer=bpe)
  cut = tmp_path / "cut"
  _prepare(STDLIB[:5], cut, shard_tokens=30_000)
  shard = cut / "shard-00001.array_record"
  shard.write_bytes(shard.read_bytes()[:-10])
  (tmp_path / "neg.json").write_text(json.dumps({"components": [
      {"path": str(datasets / "a"), "weight": -1}]}))
  base = cli_args(options(str(tmp_path / "out"), config_file))
  cases = {
      r"shard-00001.array_record: \d+ bytes, manifest.json says \d+ \(truncated or replaced\)":
          ["--data", str(cut)],
      "neg.json: component 0: weight -1": ["--data-mix", str(tmp_path / "neg.json")],
      "--data and --data-mix are exclusive": ["--data", str(cut), "--data-mix",
                                              str(datasets / "mix.json")],
      "--format chat reads JSONL conversations; a prepared dataset": [
          "--data", str(datasets / "a"), "--format", "chat"],
      # last: checked once the run's tokenizer is loaded, after the run folder is made
      "was prepared with the tiktoken tokenizer .* the run trains with the byte tokenizer":
          ["--data", str(tmp_path / "bpe_data")],
  }
  for message, extra in cases.items():
    code = main(base + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (message, err)
    assert re.search(message, err[0]), (message, err[0])
    if "tokenizer" not in message:  # refused before the run folder is made
      assert not (tmp_path / "out").exists(), message


def test_a_resume_refuses_an_edited_mixture_or_a_dataset_prepared_again(
    straight, tmp_path, config_file, datasets, capsys):
  summary, _ = straight
  run_file = os.path.join(summary["out"], RUN_FILE)
  # the run's own mixture file, edited in place: its content hash changes
  original = (datasets / "mix.json").read_text()
  edited = json.loads(original)
  edited["components"][0]["weight"] = 0.5
  (datasets / "mix.json").write_text(json.dumps(edited))
  try:
    with pytest.raises(UserError, match=r"content hash .* \(the mixture file was edited\)"):
      inputs.choose_data(None, str(datasets / "mix.json"), "text", run_file)
    # as a new stage: accepted, and a change (stages.check_stage)
    assert inputs.choose_data(None, str(datasets / "mix.json"), "text", run_file,
                              new_stage=True).changed
  finally:
    (datasets / "mix.json").write_text(original)
  inputs.choose_data(None, str(datasets / "mix.json"), "text", run_file)  # as it was: fine
  # a component prepared again (other shard sizes) at the same path
  again = tmp_path / "again"
  _prepare(STDLIB[:40], again, shard_tokens=100_000)
  saved = json.loads(open(run_file).read())
  saved["data"]["manifests"] = {str(again): "0" * 32}
  fake = tmp_path / "run" / RUN_FILE
  fake.parent.mkdir()
  fake.write_text(json.dumps(saved))
  with pytest.raises(UserError, match=r"again as prepared then .* \(prepared again\?\)"):
    inputs.choose_data(str(again), None, "text", str(fake))


def test_text_documents_end_with_the_end_of_document_id_from_version_2(tmp_path):
  bpe = load_tokenizer("auto", tiny_bpe(tmp_path / "bpe"))
  docs = [data_lib.Document(f"d{i:02d}", b"def x " * (i + 3)) for i in range(40)]
  train, held = data_lib.split_documents(docs)
  for version, eos in ((2, EOS_ID), (1, None)):
    want = [np.append(bpe.encode(d.data, allow_special=False), EOS_ID) if eos else
            bpe.encode(d.data, allow_special=False) for d in train]
    got = data_lib.tokenize(train, bpe, bpe.eos_id if version >= 2 else None)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
  # a single document split by its tail: the head has no end, the tail ends it
  head, tail = data_lib.split_documents([data_lib.Document("one", b"def x " * 40)])
  assert data_lib.tokenize(head, bpe, EOS_ID)[0][-1] != EOS_ID
  assert data_lib.tokenize(tail, bpe, EOS_ID)[0][-1] == EOS_ID
  # bytes have no end-of-document id: the version changes nothing
  assert ByteTokenizer.eos_id is None
  # the version: new runs 2, a run file from before (no "data" entry) 1
  run_file = tmp_path / "old" / RUN_FILE
  assert inputs.choose_data(None, None, "text", str(run_file)).version == 2
  run_file.parent.mkdir()
  run_file.write_text(json.dumps({"options": {}}))
  assert inputs.choose_data(None, None, "text", str(run_file)).version == 1
