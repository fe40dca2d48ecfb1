"""The input pipeline: pieces, packing, loss masks, determinism and resumption, the eval split,
and tokenizer selection. No model here."""

import numpy as np
import pytest

from k3jax import tokenizer
from k3jax.errors import UserError
from k3jax.train import data

T = 16


def docs_tokens(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).astype(np.int32) for n in lengths]


def test_pieces_cover_every_next_token_pair_once():
  lengths = [1, 2, 16, 17, 18, 40, 5]
  docs = docs_tokens(lengths)
  table = data.pieces(lengths, T)
  pairs = []
  for doc, start in table:
    piece = docs[doc][start:start + T + 1]
    assert 2 <= len(piece) <= T + 1
    pairs += [(doc, start + i) for i in range(len(piece) - 1)]
  want = [(d, i) for d, n in enumerate(lengths) for i in range(n - 1)]
  assert sorted(pairs) == want  # each (document, position) predicts its successor exactly once


def test_rows_to_batch_masks_boundaries_and_padding():
  tokens = np.array([[10, 11, 12, 20, 21, 0, 0]])
  seg = np.array([[1, 1, 1, 2, 2, 0, 0]])
  b = data.rows_to_batch(tokens, seg, micro_batches=1)
  np.testing.assert_array_equal(b["inputs"][0], [[10, 11, 12, 20, 21, 0]])
  np.testing.assert_array_equal(b["targets"][0], [[11, 12, 20, 21, 0, 0]])
  np.testing.assert_array_equal(b["segment_ids"][0], [[1, 1, 1, 2, 2, 0]])
  # 12 -> 20 crosses into the next sequence, 21 -> pad and pad -> pad are padding
  np.testing.assert_array_equal(b["loss_mask"][0], [[1, 1, 0, 1, 0, 0]])


def _segments(row_tokens, row_seg):
  return [row_tokens[row_seg == s] for s in np.unique(row_seg) if s != 0]


def test_packed_batches_hold_whole_pieces_and_resume_exactly():
  lengths = [3, 7, 40, 9, 33, 2, 25, 60, 4, 11]
  docs = docs_tokens(lengths, seed=1)
  cfg = data.PipelineConfig(seq_len=T, batch_rows=4, micro_batches=2, seed=3)
  table = data.pieces(lengths, T)
  expected = {tuple(docs[d][s:s + T + 1]) for d, s in table}
  ds = data.train_dataset(docs, cfg)
  it = data.iterate(ds)
  seen, packed_rows = [], 0
  for _ in range(6):
    batch = next(it)
    assert batch["inputs"].shape == (2, 2, T)
    rows_in = batch["inputs"].reshape(-1, T)
    rows_tg = batch["targets"].reshape(-1, T)
    rows_seg = batch["segment_ids"].reshape(-1, T)
    rows_mask = batch["loss_mask"].reshape(-1, T)
    for r in range(rows_in.shape[0]):
      for s in np.unique(rows_seg[r]):
        if s == 0:
          continue
        where = np.flatnonzero(rows_seg[r] == s)
        # inside a segment every position but the last predicts the next token of the segment
        assert rows_mask[r, where[:-1]].all()
        # a segment is one whole piece of one document (its last token is the last position's
        # target when the segment reaches the end of the row)
        piece = list(rows_in[r, where])
        if rows_mask[r, where[-1]]:
          assert where[-1] == T - 1
          piece.append(rows_tg[r, -1])
        assert tuple(piece) in expected
        seen.append(tuple(piece))
      assert not rows_mask[r][rows_seg[r] == 0].any()
      packed_rows += len(set(rows_seg[r].tolist()) - {0}) >= 2
  assert len(set(seen)) > 10 and packed_rows > 0
  state = it.get_state()
  ahead = [next(it) for _ in range(3)]
  again = data.iterate(data.train_dataset(docs, cfg), state)
  for a, b in zip(ahead, [next(again) for _ in range(3)]):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  it.close()
  again.close()


def test_same_seed_same_stream_other_seed_other_stream():
  docs = docs_tokens([50] * 12, seed=2)
  first = lambda seed: next(iter(data.train_dataset(
      docs, data.PipelineConfig(T, 4, 1, seed))))["inputs"]
  np.testing.assert_array_equal(first(0), first(0))
  assert not np.array_equal(first(0), first(1))


def test_eval_batches_are_fixed():
  docs = docs_tokens([50, 70, 31], seed=4)
  cfg = data.PipelineConfig(T, 4, 1, 0)
  a, b = data.eval_batches(docs, cfg, 2), data.eval_batches(docs, cfg, 2)
  assert len(a) == 2
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
  with pytest.raises(UserError, match="eval split"):
    data.eval_batches(docs_tokens([5]), cfg, 1)


def test_split_by_document_or_by_tail():
  many = [data.Document(f"d{i:02d}", bytes([i]) * 10) for i in range(40)]
  train, held = data.split_documents(many)
  assert [d.name for d in held] == ["d08", "d24"]
  assert len(train) == 38 and not {d.name for d in held} & {d.name for d in train}
  few = [data.Document("a", bytes(range(160))), data.Document("b", bytes(range(32)))]
  train, held = data.split_documents(few)
  assert [len(d.data) for d in train] == [150, 30] and [len(d.data) for d in held] == [10, 2]
  assert train[0].data + held[0].data == few[0].data


def test_stdlib_corpus_is_sorted_and_deterministic():
  a, b = data.stdlib_documents(), data.stdlib_documents()
  assert [d.name for d in a] == sorted(d.name for d in a) == [d.name for d in b]
  assert len(a) > 50 and all(d.name.endswith(".py") for d in a)


def test_folder_corpus(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "b.txt").write_text("bee")
  (tmp_path / "sub" / "a.md").write_text("ay")
  (tmp_path / "skip.bin").write_bytes(b"\0")
  assert [d.name for d in data.folder_documents(str(tmp_path))] == ["b.txt", "sub/a.md"]
  with pytest.raises(UserError):
    data.folder_documents(str(tmp_path / "missing"))


def test_byte_tokenizer_round_trip():
  tok = tokenizer.ByteTokenizer()
  ids = tok.encode("é\nx")
  assert ids.dtype == np.int32 and list(ids) == [0xC3, 0xA9, 10, 120]
  assert tok.decode(ids) == "é\nx"


def test_tokenizer_choice(tmp_path, monkeypatch):
  assert tokenizer.load_tokenizer("auto", None).name == "byte"
  assert tokenizer.load_tokenizer("auto", str(tmp_path)).name == "byte"  # no tiktoken.model
  with pytest.raises(UserError, match="no tiktoken.model"):
    tokenizer.load_tokenizer("tiktoken", str(tmp_path))
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "tiktoken.model").write_text("")
  assert tokenizer.find_tiktoken_file(str(tmp_path)) == str(tmp_path / "hf" / "tiktoken.model")
  assert tokenizer.load_tokenizer("byte", str(tmp_path)).name == "byte"
  # the folder brings a BPE but the optional package is absent: a clear error, not bytes
  monkeypatch.setattr(tokenizer.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(UserError, match="tiktoken"):
    tokenizer.load_tokenizer("auto", str(tmp_path))


def test_bpe_pattern_is_read_without_running_the_file(tmp_path):
  (tmp_path / "tokenization_kimi.py").write_text(
      'raise RuntimeError("never executed")\n'
      "class T:\n"
      "  def __init__(self):\n"
      '    self.pat_str = "|".join([r"""[a-z]+""", r"""\\d{1,3}"""])\n')
  assert tokenizer.read_pattern(str(tmp_path)) == r"[a-z]+|\d{1,3}"


def test_folder_bpe_encodes_with_its_merges_and_special_tokens(tmp_path):
  """A tiny BPE in the checkpoint-folder layout (tiktoken.model ranks, tokenization_*.py with
  pat_str, tokenizer_config.json added tokens): merges apply, text round-trips, and a special
  token's text inside a document stays ordinary text."""
  import base64
  merges = [b"de", b"def", b" x"]
  ranks = [bytes([i]) for i in range(256)] + merges
  (tmp_path / "tiktoken.model").write_text(
      "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
  (tmp_path / "tokenization_kimi.py").write_text(
      'pat_str = "|".join([r"""[a-z]+""", r""" ?[a-z]+""", r"""[^a-z]"""])\n')
  (tmp_path / "tokenizer_config.json").write_text(
      '{"added_tokens_decoder": {"259": {"content": "<|eos|>"}}}')
  tok = tokenizer.load_tokenizer("auto", str(tmp_path))
  assert tok.name == "tiktoken" and tok.vocab_size == 260
  ids = tok.encode("def x(")
  assert list(ids) == [257, 258, ord("(")]
  assert tok.decode(ids) == "def x("
  # as transformers encodes text, special-token text is the special token; in a training
  # document (allow_special=False, what data.tokenize uses) it stays ordinary text
  assert tok.encode("<|eos|>").tolist() == [259]
  assert 259 not in tok.encode("<|eos|>", allow_special=False)
  assert 259 not in data.tokenize([data.Document("d", b"<|eos|>")], tok)[0]


def _process_rows(b: int, n: int) -> dict[int, tuple[int, int]]:
  """The rows each of n processes holds on a data mesh axis (contiguous, equal blocks)."""
  return {p: (p * b // n, (p + 1) * b // n) for p in range(n)}


def _global_batches(its, steps, close=True):
  """`steps` batches of every process's iterator, rows concatenated in process order (the
  iterators closed afterwards unless `close` is False: their prefetch threads stop)."""
  out = []
  for _ in range(steps):
    parts = [next(it) for it in its]
    out.append({k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]})
  for it in its if close else ():
    it.close()
  return out


@pytest.mark.parametrize("shards", [1, 2])
def test_global_batch_and_data_position_do_not_depend_on_the_process_count(shards):
  lengths = [3, 7, 40, 9, 33, 2, 25, 60, 4, 11, 50, 18]
  docs = docs_tokens(lengths, seed=2)
  b = 4
  cfg = data.PipelineConfig(seq_len=T, batch_rows=2 * b, micro_batches=2, seed=5,
                            num_shards=shards)
  # the reference: the shard pipelines themselves, read whole, rows in shard order
  pipes = [data.iterate(data.train_dataset(docs, cfg, shard=s)) for s in range(shards)]
  want = _global_batches(pipes, 5, close=False)
  for it in pipes:
    it.close()
  opener = data.in_memory_shards(docs, cfg)
  for n in (1, 2, 4):
    its = [data.ShardIterator(opener, cfg, rows) for rows in _process_rows(b, n).values()]
    got = _global_batches(its, 5)
    for g, w in zip(got, want):
      for k in w:
        np.testing.assert_array_equal(g[k], w[k], err_msg=f"{n} processes, {k}")
  # a data position saved under n processes (each shard's state from its lowest reader)
  # resumes under m with the same next batches
  for n, m in ((2, 1), (1, 4), (4, 2)):
    by_process = _process_rows(b, n)
    its = [data.ShardIterator(opener, cfg, rows) for rows in by_process.values()]
    _global_batches(its, 2, close=False)
    writers = data.shard_writers(cfg, by_process)
    saved = {}
    for p, it in enumerate(its):
      saved.update({k: v for k, v in it.get_state().items() if writers[int(k)] == p})
      it.close()
    assert sorted(saved) == [str(s) for s in range(shards)]
    resumed = [data.ShardIterator(opener, cfg, rows, state=saved)
               for rows in _process_rows(b, m).values()]
    for g, w in zip(_global_batches(resumed, 3), want[2:5]):
      for k in w:
        np.testing.assert_array_equal(g[k], w[k], err_msg=f"saved on {n}, resumed on {m}")


def test_a_data_position_of_other_shards_is_refused():
  docs = docs_tokens([40, 33, 60, 25], seed=2)
  cfg = data.PipelineConfig(seq_len=T, batch_rows=4, micro_batches=1, seed=0, num_shards=2)
  with pytest.raises(UserError, match="no data position for data shard 1"):
    data.ShardIterator(data.in_memory_shards(docs, cfg), cfg, state={"0": {}})
