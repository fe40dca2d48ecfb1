"""Chat SFT data: whole conversations packed with segment ids and an assistant-only loss mask,
bad rows reported by line number (refused, or skipped when asked), and a short
`k3jax train --format chat` run on the micro model that lowers the loss, then a LoRA run from
its checkpoint (MXFP4 experts) that lowers it further."""

import json
import os

import numpy as np
import pytest

from k3jax.cli import main
from k3jax.errors import UserError
from k3jax.tokenizer import load_tokenizer
from k3jax.train import chat_data
from k3jax.train import data as data_lib
from k3jax.train.loop import run

from ..tokenizer import conversations, release
from .helpers import MICRO, options


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("k3_tokenizer"))
  release.build(path)
  return path


@pytest.fixture(scope="module")
def tok(folder):
  return load_tokenizer("auto", folder)


def write_jsonl(path, lines):
  with open(path, "w") as f:
    f.writelines((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
  return str(path)


def rows():
  return [{"messages": m, "tools": t} for m, t in conversations.CONVERSATIONS.values()]


def test_conversations_pack_whole_with_an_assistant_only_loss_mask(tok, tmp_path):
  corpus = chat_data.read_chat(write_jsonl(tmp_path / "d.jsonl", rows()), tok, seq_len=768)
  assert not corpus.bad and len(corpus.tokens) == len(rows())
  t = 768
  cfg = data_lib.PipelineConfig(seq_len=t, batch_rows=2, micro_batches=1, seed=0)
  it = data_lib.iterate(data_lib.train_dataset(corpus.tokens, cfg, corpus.weights))
  seen, shared_rows = set(), 0
  for _ in range(6):
    batch = {k: v.reshape(-1, t) for k, v in next(it).items()}
    for r in range(2):
      seg = batch["segment_ids"][r]
      segments = [s for s in np.unique(seg) if s]
      shared_rows += len(segments) > 1
      for s in segments:
        where = np.flatnonzero(seg == s)
        n = len(where)
        assert where[-1] - where[0] + 1 == n  # contiguous
        got = batch["inputs"][r, where]
        # a segment is one whole conversation: all of it, or all but its last token when that
        # token sits in the row's final target slot
        (k,) = [k for k, row in enumerate(corpus.tokens) if len(row) in (n, n + 1)
                and np.array_equal(row[:n], got)]
        assert n == len(corpus.tokens[k]) or where[-1] == t - 1
        # trained exactly where the target is an assistant token, never across the boundary
        want = np.append(corpus.weights[k][1:], 0)[:n].astype(bool)
        np.testing.assert_array_equal(batch["loss_mask"][r, where], want)
        seen.add(k)
      assert not batch["loss_mask"][r][seg == 0].any()
  it.close()
  assert len(seen) == len(rows()) and shared_rows > 0
  # eval keeps a last partial batch, padded with empty rows
  batches = data_lib.eval_batches(corpus.tokens[:1], cfg, 4, corpus.weights[:1])
  assert len(batches) == 1 and batches[0]["loss_mask"].sum() == corpus.weights[0][1:].sum()
  assert not batches[0]["segment_ids"][0, 1].any()


def test_bad_rows_are_reported_by_line_number(tok, tmp_path):
  good = rows()[0]
  lines = [
      good,                                                                   # 1
      '{"messages": [',                                                       # 2
      {"messages": [{"role": "bot", "content": "x"}]},                        # 3
      "",                                                                     # 4: no row
      {"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]},  # 5
      {"messages": [{"role": "user", "content": "z " * 200},
                    {"role": "assistant", "content": "y"}]},                  # 6
      {"messages": conversations.REWRITES_HISTORY},                           # 7
      good,                                                                   # 8
  ]
  path = write_jsonl(tmp_path / "d.jsonl", lines)
  corpus = chat_data.read_chat(path, tok, seq_len=128)
  assert corpus.lines == ["d.jsonl:1", "d.jsonl:8"]
  assert [w for w, _ in corpus.bad] == [f"d.jsonl:{n}" for n in (2, 3, 5, 6, 7)]
  for (_, reason), needle in zip(corpus.bad, ["invalid JSON", "unknown role 'bot'",
                                              "missing content", "too long", "differently"]):
    assert needle in reason
  with pytest.raises(UserError, match=r"5 of 7 rows are bad \(d.jsonl:2: invalid JSON .*"
                                      r"d.jsonl:5: message 1 \(user\): missing content; and 2 "
                                      r"more\); fix them, or pass --skip-bad-rows"):
    chat_data.check_bad_rows(corpus, path, skip=False, out=str(tmp_path))
  report = chat_data.check_bad_rows(corpus, path, skip=True, out=str(tmp_path))
  with open(report) as f:
    assert [json.loads(x)["line"] for x in f] == [w for w, _ in corpus.bad]
  only_bad = chat_data.read_chat(write_jsonl(tmp_path / "b.jsonl", lines[1:3]), tok, 128)
  with pytest.raises(UserError, match="all 2 rows are bad"):
    chat_data.check_bad_rows(only_bad, path, skip=True, out=str(tmp_path))


def sum_rows(n):
  """Conversations a tiny model learns in a few steps: fixed phrasing, sums as answers."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    a, b = (int(x) for x in rng.integers(0, 50, 2))
    out.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
  return out


# the micro model cut to one KDA and one MLA layer (dense, then LatentMoE): this test is about
# the data path, and every layer less is compile time saved; the vocabulary holds the test
# folder's 712 ids
CHAT_MODEL = MICRO.replace(num_layers=2, mla_layers=(1,), vocab_size=768)
STEPS = 10


@pytest.mark.long
def test_chat_sft_run_lowers_the_loss(folder, tok, tmp_path, capsys):
  cfg_file = tmp_path / "micro.json"
  cfg_file.write_text(json.dumps({"format": "k3jax", "config": CHAT_MODEL.to_dict()}))
  data = write_jsonl(tmp_path / "sft.jsonl", sum_rows(40))
  common = dict(data=data, data_format="chat", tokenizer=folder, seq_len=128, steps=STEPS,
                decay_steps=STEPS, eval_every=STEPS, save_every=STEPS, plots=False,
                tensorboard=False)
  summary = run(options(tmp_path / "run", str(cfg_file), **common))
  d = summary["data"]
  assert (d["rows"], d["bad_rows"], d["train_rows"], d["eval_rows"]) == (40, 0, 38, 2)
  assert d["bad_rows_file"] is None
  assert 0 < d["trained_tokens"] < d["train_tokens"] / 2
  # a fresh model starts near ln(768) = 6.6 nats per trained token; the answers' fixed
  # phrasing ("a plus b is c.<|im_end|>") alone is worth well over 2 nats of that
  assert summary["last_loss"] < summary["first_loss"] - 2.0, summary
  assert summary["eval_loss"] < summary["first_loss"] - 2.0, summary
  # the CLI refuses a data set with a bad row, in one line, before training
  bad = write_jsonl(tmp_path / "bad.jsonl", sum_rows(3) + [{"messages": [{"role": "bot"}]}])
  capsys.readouterr()
  code = main(["train", "--out", str(tmp_path / "refused"), "--config", str(cfg_file),
               "--format", "chat", "--data", bad, "--tokenizer", folder, "--compile-cache",
               "none", "--no-progress"])
  err = capsys.readouterr().err
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "1 of 4 rows are bad (bad.jsonl:4: message 1: unknown role 'bot'" in err
  # a tokenizer larger than the model's vocabulary is refused, not silently clipped
  with pytest.raises(UserError, match="712 ids but the model only 256"):
    run(options(tmp_path / "small", "tiny", **common))
  assert os.path.isfile(os.path.join(summary["out"], "model", "k3jax_config.json"))
  # LoRA SFT on the same chat set from the trained checkpoint, its routed experts held as
  # MXFP4 codes: the adapters alone (rank 4 on the default targets: MLA, KDA, shared experts,
  # dense MLP) go on lowering the assistant-token loss below what the base reached (measured:
  # eval 4.11 -> 3.18 nats, first 3.92 -> last 3.24; lr 3e-2, the adapters' AdamW)
  lora_run = run(options(tmp_path / "lora", None, init_from=os.path.join(summary["out"], "model"),
                         lora_rank=4, base_experts="mxfp4", **(common | {"learning_rate": 3e-2})))
  assert 0 < lora_run["trainable_params"] < lora_run["total_params"] / 10
  assert lora_run["data"]["trained_tokens"] == d["trained_tokens"]
  assert lora_run["last_loss"] < lora_run["first_loss"] - 0.3, lora_run
  assert lora_run["eval_loss"] < summary["eval_loss"] - 0.3, (lora_run, summary)
