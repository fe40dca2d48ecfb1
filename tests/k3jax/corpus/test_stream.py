"""Reading prepared datasets: the mixture's interleave and its shares, first-fit packing of a
group, epochs and the hold-out, per-process reads that are disjoint and add up to the
one-process batch, resumption under another worker count, and the refusals of a manifest that
does not match its shards or a bad mixture file."""

import json
import os

import numpy as np
import pytest

from k3jax.corpus import mixture, stream
from k3jax.corpus import prepare as prepare_lib
from k3jax.corpus.prepared import PreparedDataset
from k3jax.errors import UserError
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import data, prepared_data

T = 16


def synthetic(folder, n, seed, lo=1, hi=60, shard_tokens=400):
  """A prepared dataset of n random byte documents; (folder, the documents)."""
  rng = np.random.default_rng(seed)
  docs = [rng.integers(0, 256, rng.integers(lo, hi)).astype(np.int32) for _ in range(n)]
  prepare_lib.write_documents(str(folder), docs, ByteTokenizer(), shard_tokens)
  return str(folder), docs


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (1 / 3, 2 / 3), (0.7, 0.29, 0.01),
                                     (3.0, 0.0, 1.0)])
def test_interleave_shares_are_exact_within_the_component_index(weights):
  """After n draws component c has given n w_c documents within c + 1, for every n up to
  10,000; each draw has one component, and draw k is the one counts() adds at k."""
  props = mixture.proportions(weights)
  share = np.asarray(weights) / sum(weights)
  seen = np.zeros(len(weights), np.int64)
  for k in range(10_000):
    c, j = mixture.pick(k, props)
    assert j == seen[c]
    seen[c] += 1
    assert (np.abs(seen - (k + 1) * share) <= np.arange(len(weights)) + 1).all(), (k, seen)
  assert seen.tolist() == mixture.counts(10_000, props)


def test_mixture_draws_documents_by_weight(tmp_path):
  """The documents a data shard reads over 10,000 draws come from each component in its
  share; with shares of tokens each weight is divided by the mean document length."""
  # thousands of documents each: Grain's index shuffle is slow on small ranges (1 ms a call
  # at 37 documents, 7 us at 10,000)
  comps = [PreparedDataset(synthetic(tmp_path / f"c{i}", 4000 + 3000 * i, i, hi=4 + 8 * i,
                                     shard_tokens=20_000)[0]) for i in range(3)]
  mix = mixture.Mixture(tuple(c.folder for c in comps), (0.6, 0.3, 0.1))
  props = prepared_data.document_proportions(mix, comps)
  spec = stream.StreamSpec(T, 0, 0, 1, 100, props, (0, 0, 0))
  source = stream.GroupSource(comps, spec)
  drawn = [c for g in range(100) for c, _ in source.documents(g)]
  assert len(drawn) == 10_000
  np.testing.assert_allclose(np.bincount(drawn) / 10_000, [0.6, 0.3, 0.1], atol=3 / 10_000)
  by_tokens = mixture.Mixture(mix.paths, mix.weights, "tokens")
  props = prepared_data.document_proportions(by_tokens, comps)
  want = np.asarray(mix.weights) / [c.mean_document_tokens for c in comps]
  np.testing.assert_allclose(np.asarray(props) / sum(props), want / want.sum(), rtol=1e-5)


def test_pack_places_every_piece_once_first_fit():
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 256, n).astype(np.int32) for n in (1, 2, 5, 17, 18, 40, 3, 9, 33)]
  rows = stream.pack(docs, T)
  tokens, seg = rows["tokens"], rows["segment_ids"]
  assert tokens.shape[1] == T + 1
  segments, free_before = [], []
  for r in range(len(tokens)):
    ids = seg[r][seg[r] > 0]
    used = len(ids)
    assert (seg[r][used:] == 0).all() and (tokens[r][used:] == 0).all()  # padding at the end
    assert (np.diff(ids) >= 0).all() and ids[0] == 1
    segments.append([tuple(tokens[r][seg[r] == s]) for s in np.unique(ids)])
    free_before.append(T + 1 - used)
  want = [tuple(d[s:s + T + 1]) for d in docs for s in range(0, max(len(d) - 1, 0), T)]
  assert sorted(p for row in segments for p in row) == sorted(want)
  # first fit, replayed: each piece in the first row with room when it came
  free = []
  for piece in want:
    row = next((i for i, f in enumerate(free) if f >= len(piece)), len(free))
    if row == len(free):
      free.append(T + 1)
    free[row] -= len(piece)
    assert piece in segments[row]
  assert free == free_before


@pytest.mark.parametrize("n", [50, 5000])  # a permutation table / Grain's index shuffle
def test_epochs_split_between_shards_and_never_touch_the_held_out(tmp_path, n):
  comp = PreparedDataset(synthetic(tmp_path / "d", n, 1, hi=4, shard_tokens=4000)[0])
  every = comp.every
  held = {comp.held_out_index(h) for h in range(comp.held_out)}
  assert held == {i for i in range(n) if i % every == every // 2} and len(held) == n // every
  trained = comp.train_documents
  assert (trained < stream.TABLE_BELOW) == (n == 50)
  for shards in (1, 2, 3):
    per = -(-trained // shards)
    first = []
    for s in range(shards):
      spec = stream.StreamSpec(T, 7, s, shards, 1, (1,), (0,))
      # positions s + p S < trained are the first epoch: every trained document once
      first += [stream.component_position(0, comp, p, spec) for p in range(per)
                if s + p * shards < trained]
    assert sorted(first) == sorted(set(range(n)) - held)
    spec = stream.StreamSpec(T, 7, 0, shards, 1, (1,), (0,))
    second = [stream.component_position(0, comp, p, spec) for p in range(per, 2 * per)]
    assert not set(second) & held and second != first[:len(second)]


def _rows(b, n):
  return {p: (p * b // n, (p + 1) * b // n) for p in range(n)}


class _Logged(PreparedDataset):
  """A reader that logs every document number it reads."""

  def __init__(self, folder, log):
    super().__init__(folder)
    self.log = log

  def read(self, indices):
    self.log.extend(indices)
    return super().read(indices)


def test_processes_read_disjoint_documents_whose_batches_add_up(tmp_path):
  """With S = 2 data shards, the readers of process 0's rows and of process 1's read disjoint
  documents (the S shards split each epoch; these batches stay inside the first), and their
  rows side by side are the one-process batch; a position saved by the two resumes on one
  process."""
  folder, _ = synthetic(tmp_path / "d", 400, 2, lo=200, hi=600, shard_tokens=20_000)
  cfg = data.PipelineConfig(seq_len=T, batch_rows=8, micro_batches=2, seed=3, num_shards=2)
  props = (1,)

  def iterator(rows, log, state=None):
    opener = prepared_data.prepared_shards([_Logged(folder, log)], props, cfg)
    return data.ShardIterator(opener, cfg, rows, state)

  one = iterator(None, [])
  want = [next(one) for _ in range(6)]
  one.close()
  logs = [[], []]
  its = [iterator(rows, logs[p]) for p, rows in _rows(4, 2).items()]
  for w in want[:4]:
    parts = [next(it) for it in its]
    for k in w:
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts], axis=1), w[k])
  assert logs[0] and logs[1] and not set(logs[0]) & set(logs[1])
  saved = {**its[0].get_state(), **its[1].get_state()}
  for it in its:
    it.close()
  again = iterator(None, [], saved)
  for w in want[4:]:
    got = next(again)
    for k in w:
      np.testing.assert_array_equal(got[k], w[k])
  again.close()


def test_worker_processes_and_a_resume_under_another_count(tmp_path):
  folder, _ = synthetic(tmp_path / "d", 80, 3)
  comp = PreparedDataset(folder)
  spec = stream.StreamSpec(T, 0, 0, 1, stream.group_documents([comp], (1,), T), (1,), (0,))
  source = stream.GroupSource([comp], spec)
  inline = stream.RowStream(source, 8)
  want = [next(inline) for _ in range(40)]
  state = inline.get_state()
  rest = [next(inline) for _ in range(3)]
  inline.close()
  assert state["group"] >= 1  # the run crossed a group
  workers = stream.RowStream(source, 8, workers=2)
  for w in want:
    got = next(workers)
    np.testing.assert_array_equal(got["tokens"], w["tokens"])
    np.testing.assert_array_equal(got["segment_ids"], w["segment_ids"])
  workers.close()
  resumed = stream.RowStream(source, 8, state, workers=1)
  for w in rest:
    np.testing.assert_array_equal(next(resumed)["tokens"], w["tokens"])
  resumed.close()


def test_a_manifest_that_does_not_match_its_shards_is_refused(tmp_path):
  folder, _ = synthetic(tmp_path / "d", 30, 4, shard_tokens=200)
  with open(os.path.join(folder, "manifest.json")) as f:
    manifest = json.load(f)
  shard = os.path.join(folder, manifest["shards"][1]["file"])
  with open(shard, "rb") as f:
    whole = f.read()
  os.rename(shard, shard + ".away")
  with pytest.raises(UserError, match=r"shard-00001.array_record: missing \(listed in "):
    PreparedDataset(folder)
  with open(shard, "wb") as f:
    f.write(whole[:-100])
  with pytest.raises(UserError, match=r"shard-00001.array_record: \d+ bytes, manifest.json "
                                      r"says \d+ \(truncated or replaced\)"):
    PreparedDataset(folder)
  with open(shard, "wb") as f:
    f.write(whole)
  PreparedDataset(folder)  # whole again
  # other counts: the manifest edited (its fingerprint no longer matches) ...
  edited = {**manifest, "shards": [{**s} for s in manifest["shards"]]}
  edited["shards"][1]["documents"] -= 1
  edited["documents"] -= 1
  with open(os.path.join(folder, "manifest.json"), "w") as f:
    json.dump(edited, f)
  with pytest.raises(UserError, match="does not match its fingerprint"):
    PreparedDataset(folder)
  # ... or a shard of other counts at the recorded size (caught when the shard is opened)
  from k3jax.corpus import manifest as manifest_lib
  manifest_lib.write(folder, edited)
  ds = PreparedDataset(folder)
  with pytest.raises(UserError, match="shard-00001.array_record: holds .* documents, its "
                                      "manifest says"):
    ds.read([ds.manifest["shards"][0]["documents"]])


def _mix(tmp_path, components, name="mix.json") -> str:
  path = tmp_path / name
  path.write_text(json.dumps(components))
  return str(path)


def test_bad_mixture_files_are_refused_in_one_line(tmp_path):
  synthetic(tmp_path / "a", 20, 5)
  (tmp_path / "plain").mkdir()
  cases = {
      "component 1: .*missing: no such folder": [{"path": "a", "weight": 1},
                                                 {"path": "missing", "weight": 1}],
      r"component 0: weight -1 \(a number >= 0\)": [{"path": "a", "weight": -1}],
      "the weights sum to 0": [{"path": "a", "weight": 0}],
      "plain is not a prepared dataset": [{"path": "plain", "weight": 1}],
      "component 0: expected": [{"path": "a", "weight": 1, "extra": 2}],
  }
  for message, components in cases.items():
    with pytest.raises(UserError, match=message):
      mixture.read(_mix(tmp_path, {"components": components}))
  with pytest.raises(UserError, match="unknown key"):
    mixture.read(_mix(tmp_path, {"components": [{"path": "a", "weight": 1}], "seed": 1}))
  (tmp_path / "broken.json").write_text("{")
  with pytest.raises(UserError, match="broken.json: not JSON"):
    mixture.read(str(tmp_path / "broken.json"))
  mix = mixture.read(_mix(tmp_path, {"components": [{"path": "a", "weight": 2}]}))
  assert mix.paths == (str(tmp_path / "a"),) and mix.weights == (2.0,)
  assert mix.content_hash != mixture.read(_mix(
      tmp_path, {"components": [{"path": "a", "weight": 3}]})).content_hash


def test_held_out_documents_follow_the_interleave(tmp_path):
  a = PreparedDataset(synthetic(tmp_path / "a", 40, 6)[0])   # 2 held out: 8, 24
  b = PreparedDataset(synthetic(tmp_path / "b", 60, 7)[0])   # 4 held out: 8, 24, 40, 56
  docs = prepared_data.held_out_documents([a, b], (1, 1), max_tokens=10**9)
  want = (a.read([8]) + b.read([8]) + a.read([24]) + b.read([24]) + b.read([40])
          + b.read([56]))
  assert len(docs) == 6
  for got, w in zip(docs, want):
    np.testing.assert_array_equal(got, w)
