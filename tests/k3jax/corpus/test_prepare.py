"""`k3jax prepare-data`: sources of every kind with broken rows, end-of-document ids,
resumption after an interruption, worker-count independence, and the bad-input refusals.
Documents are checked against the tokenizer's own encoding of each source text."""

import json
import os

import fsspec
import numpy as np
import pytest

from k3jax.cli import main
from k3jax.corpus import manifest as manifest_lib
from k3jax.corpus import prepare as prepare_lib
from k3jax.corpus.prepared import PreparedDataset
from k3jax.corpus.shards import ShardWriter
from k3jax.errors import UserError
from k3jax.tokenizer import load_tokenizer

from .helpers import EOS_ID, EOS_TEXT, tiny_bpe, write_sources


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  return tiny_bpe(tmp_path_factory.mktemp("bpe"))


def _prepare(sources, out, **kw):
  opts = prepare_lib.PrepareOptions(sources=tuple(map(str, sources)), out=str(out),
                                    workers=kw.pop("workers", 0), progress=False, **kw)
  return prepare_lib.prepare(opts)


def _documents(out) -> list[np.ndarray]:
  ds = PreparedDataset(str(out))
  return ds.read(range(ds.documents))


def _rejected(out) -> list[dict]:
  with open(os.path.join(out, manifest_lib.REJECTED_FILE)) as f:
    return [json.loads(line) for line in f]


def _files(folder) -> dict[str, bytes]:
  out = {}
  for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name), "rb") as f:
      out[name] = f.read()
  return out


def test_text_jsonl_parquet_with_bad_rows_counts_and_rejections(tmp_path, bpe, capsys):
  good, rejected = write_sources(tmp_path / "src")
  tok = load_tokenizer("auto", bpe)
  summary = _prepare([tmp_path / "src"], tmp_path / "out", tokenizer=bpe, shard_tokens=20)
  docs = _documents(tmp_path / "out")
  want = [np.append(tok.encode(t, allow_special=False), EOS_ID) for t in good]
  assert len(docs) == len(want) == summary["documents"] == 8
  for got, w in zip(docs, want):
    np.testing.assert_array_equal(got, w)
  assert summary["tokens"] == sum(map(len, want)) and summary["rejected"] == len(rejected)
  assert _rejected(tmp_path / "out") == rejected
  m = manifest_lib.read(str(tmp_path / "out"))
  assert m["complete"] and m["token_dtype"] == "uint16" and m["tokenizer"]["eos_id"] == EOS_ID
  assert m["end_of_document"] == f"id {EOS_ID} ({EOS_TEXT}) appended to every document"
  assert [s["kind"] for s in m["sources"]] == ["text", "text", "jsonl", "text", "parquet"]
  # shards close at 20 tokens on document boundaries, every count adds up
  assert all(s["tokens"] >= 20 for s in m["shards"][:-1]) and len(m["shards"]) > 2
  assert sum(s["documents"] for s in m["shards"]) == 8
  err = capsys.readouterr().err
  assert f"rejected {rejected[0]['source']}: not UTF-8 (byte 3)" in err
  assert err.count("k3jax prepare-data: rejected") == prepare_lib.PRINTED_REJECTIONS


def test_end_of_document_once_per_document(tmp_path, bpe):
  """The end-of-document id ends every document and appears nowhere else, also where a
  document holds its text (a training document's special-token text is ordinary text)."""
  good, _ = write_sources(tmp_path / "src")
  _prepare([tmp_path / "src"], tmp_path / "out", tokenizer=bpe)
  docs = _documents(tmp_path / "out")
  assert any(EOS_TEXT in t for t in good)
  for d in docs:
    assert d[-1] == EOS_ID and int((d == EOS_ID).sum()) == 1
  # bytes: no end-of-document id, and the manifest says so
  _prepare([tmp_path / "src"], tmp_path / "bytes")
  m = manifest_lib.read(str(tmp_path / "bytes"))
  assert m["tokenizer"]["eos_id"] is None and m["end_of_document"].startswith("none")
  assert [bytes(d.astype(np.uint8)).decode() for d in _documents(tmp_path / "bytes")] == good


def test_fsspec_urls_file_and_memory(tmp_path):
  mem = fsspec.filesystem("memory")
  mem.pipe("/corpus/x.jsonl", b'{"text": "from memory"}\n{"text": 1}\n')
  mem.pipe("/corpus/y.txt", b"a memory text file")
  (tmp_path / "z.txt").write_text("a local file by URL")
  summary = _prepare(["memory://corpus", f"file://{tmp_path}/z.txt"], tmp_path / "out")
  texts = [bytes(d.astype(np.uint8)).decode() for d in _documents(tmp_path / "out")]
  assert texts == ["from memory", "a memory text file", "a local file by URL"]
  assert summary["rejected"] == 1
  assert _rejected(tmp_path / "out")[0]["source"] == "memory:///corpus/x.jsonl"


def test_interrupted_prepare_resumes_to_the_same_bytes(tmp_path, bpe, monkeypatch):
  write_sources(tmp_path / "src")
  _prepare([tmp_path / "src"], tmp_path / "whole", tokenizer=bpe, shard_tokens=12)
  write = ShardWriter.write
  calls = {"n": 0}

  def dies_at_the_sixth_document(self, ids):
    calls["n"] += 1
    if calls["n"] == 6:
      raise KeyboardInterrupt
    write(self, ids)

  monkeypatch.setattr(ShardWriter, "write", dies_at_the_sixth_document)
  with pytest.raises(KeyboardInterrupt):
    _prepare([tmp_path / "src"], tmp_path / "cut", tokenizer=bpe, shard_tokens=12)
  monkeypatch.setattr(ShardWriter, "write", write)
  m = manifest_lib.read(str(tmp_path / "cut"))
  assert not m["complete"] and 0 < len(m["shards"]) < 8
  # what a killed run leaves beyond the manifest: a half-written shard, unlisted rejections
  (tmp_path / "cut" / "shard-00007.array_record.tmp").write_bytes(b"half")
  with open(tmp_path / "cut" / manifest_lib.REJECTED_FILE, "a") as f:
    f.write('{"source": "unlisted"}\n')
  with pytest.raises(UserError, match="prepare-data has not finished"):
    PreparedDataset(str(tmp_path / "cut"))
  summary = _prepare([tmp_path / "src"], tmp_path / "cut", tokenizer=bpe, shard_tokens=12)
  assert summary["resumed_after_shards"] == len(m["shards"])
  assert _files(tmp_path / "cut") == _files(tmp_path / "whole")
  again = _prepare([tmp_path / "src"], tmp_path / "cut", tokenizer=bpe, shard_tokens=12)
  assert again["added_documents"] == 0  # complete: nothing to do


def test_worker_processes_give_the_same_shards(tmp_path, bpe):
  write_sources(tmp_path / "src")
  _prepare([tmp_path / "src"], tmp_path / "inline", tokenizer=bpe, shard_tokens=15)
  _prepare([tmp_path / "src"], tmp_path / "two", tokenizer=bpe, shard_tokens=15, workers=2,
           batch_items=2)
  assert _files(tmp_path / "two") == _files(tmp_path / "inline")


def test_strict_refuses_at_the_first_bad_row(tmp_path, capsys):
  _, rejected = write_sources(tmp_path / "src")
  code = main(["prepare-data", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
               "--workers", "0", "--strict", "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and err == [f"k3jax prepare-data: error: {rejected[0]['source']}: not "
                               "UTF-8 (byte 3) (--strict: no row is skipped)"]
  assert not manifest_lib.read(str(tmp_path / "out"))["complete"]


def _refused(capsys, tmp_path, *args) -> str:
  out = tmp_path / "out"
  code = main(["prepare-data", *map(str, args), "--out", str(out), "--workers", "0",
               "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert not out.exists()  # nothing written
  return err[0]


def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
  pq.write_table(pa.table({"body": ["a"]}), tmp_path / "body.parquet")
  (tmp_path / "nofield.jsonl").write_text('{"body": "a"}\nnot json\n{"text": 3}\n')
  (tmp_path / "fine.jsonl").write_text('{"text": "a"}\n')
  assert _refused(capsys, tmp_path, tmp_path / "ints.parquet").endswith(
      "ints.parquet: column 'text' is int64, not text")
  assert _refused(capsys, tmp_path, tmp_path / "body.parquet").endswith(
      "body.parquet: no column 'text' (columns: body); pass --text-field")
  assert _refused(capsys, tmp_path, tmp_path / "fine.jsonl", tmp_path / "nofield.jsonl"
                  ).endswith("nofield.jsonl: no row of its 3 has a string field 'text' (fields "
                             "seen: body, text); pass --text-field")
  assert _refused(capsys, tmp_path, tmp_path / "missing").endswith("missing: no such file or "
                                                                  "folder")
  assert "no such folder" in _refused(capsys, tmp_path, tmp_path / "fine.jsonl",
                                      "--tokenizer", tmp_path / "nomodel")


def test_another_prepare_in_the_folder_is_refused(tmp_path, capsys):
  (tmp_path / "a.txt").write_text("first")
  (tmp_path / "b.txt").write_text("second")
  assert main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"),
               "--workers", "0", "--no-progress"]) == 0
  capsys.readouterr()
  assert main(["prepare-data", str(tmp_path / "b.txt"), "--out", str(tmp_path / "out"),
               "--workers", "0", "--no-progress"]) == 2
  assert "holds a prepare with other SRC" in capsys.readouterr().err
