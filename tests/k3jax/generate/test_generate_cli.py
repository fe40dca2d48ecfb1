"""`k3jax generate` end to end: greedy float64 generation reproduces the official greedy
continuations of both k3_tiny_a reference files; a `k3jax train`-style output folder (byte
tokenizer) generates text, streamed or as JSON, in batches of different lengths, with stop
tokens, sampling by seed, and under a device mesh; bad input is one line and exit 2."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.cli import main
from k3jax.model.transformer import K3Model
from k3jax.train.checkpoint import save_model
from k3jax.train.step import split_model
from tests.k3jax.model.helpers import randomize, tiny_cfg

FILES = ("reference.npz", "reference_b2_t130.npz")
COMMON = ["--compile-cache", "none", "--prefill-chunk", "64"]


def generate(capsys, *args):
  capsys.readouterr()
  rc = main(["generate", *args, *COMMON])
  out = capsys.readouterr()
  return rc, out.out, out.err


# The folder stores MXFP4 experts: the default keeps them packed, --experts dequantized does not;
# both reproduce the official run.
@pytest.mark.parametrize("fname,experts",
                         [(FILES[0], []), (FILES[1], ["--experts", "dequantized"])])
def test_greedy_reproduces_the_official_continuation(reference_dir, capsys, fname, experts):
  hf = os.path.join(reference_dir, "k3_tiny_a")
  ref = np.load(os.path.join(hf, fname))
  p, want = int(ref["decode_prefill_len"]), ref["greedy_tokens"]
  prompts = [a for row in ref["input_ids"][:, :p]
             for a in ("--prompt-ids", ",".join(map(str, row)))]
  rc, out, _ = generate(capsys, hf, *prompts, "--dtype", "float64", "--temperature", "0",
                        "--max-new-tokens", str(want.shape[1]), "--ignore-eos", "--json",
                        "--block", "12", *experts)
  rows = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["index"])
  assert rc == 0 and [r["tokens"] for r in rows] == want.tolist()
  assert all(r["finish_reason"] == "length" for r in rows)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """What `k3jax train --out DIR` leaves: DIR/run.json and DIR/model (byte tokenizer)."""
  out = tmp_path_factory.mktemp("run")
  cfg = tiny_cfg(vocab_size=256, num_layers=2, mla_layers=(1,))
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  for _, var in nnx.to_flat_state(nnx.state(model)):
    var.set_value(jax.numpy.zeros(var.shape, var.dtype))
  graphdef, params, bias = split_model(randomize(model, 2, scale=3.0))
  save_model(str(out / "model"), graphdef, params, bias, cfg)
  (out / "run.json").write_text(json.dumps({"options": {"tokenizer": "byte", "init_from": None},
                                            "model": cfg.to_dict()}))
  return str(out)


def test_text_streamed_equals_json(run_dir, capsys):
  args = [run_dir, "--prompt", "def f(x):", "--max-new-tokens", "10", "--dtype", "float64"]
  rc, streamed, err = generate(capsys, *args)   # blocks of 8: streamed in two pieces
  assert rc == 0 and "new tokens" in err
  rc, out, _ = generate(capsys, *args, "--json")
  row = json.loads(out)
  assert len(row["tokens"]) == 10 and row["prompt_tokens"] == len("def f(x):")
  assert row["text"] == bytes(row["tokens"]).decode("utf-8", errors="replace")
  assert streamed == row["text"] + "\n"


def test_batch_of_different_lengths_and_stop(run_dir, capsys):
  """Each prompt of a batch generates what it generates alone; a stop token ends its row."""
  prompts = ["a", "longer prompt here"]
  alone = []
  for p in prompts:
    _, out, _ = generate(capsys, run_dir, "--prompt", p, "--max-new-tokens", "6", "--json",
                         "--dtype", "float64")
    alone.append(json.loads(out)["tokens"])
  rc, out, _ = generate(capsys, run_dir, "--prompt", prompts[0], "--prompt", prompts[1],
                        "--max-new-tokens", "6", "--json", "--dtype", "float64")
  rows = {r["index"]: r for r in map(json.loads, out.splitlines())}
  assert rc == 0 and [rows[i]["tokens"] for i in range(2)] == alone
  stop = alone[1][2]
  _, out, _ = generate(capsys, run_dir, "--prompt", prompts[1], "--max-new-tokens", "6",
                       "--json", "--dtype", "float64", "--stop", str(stop))
  row = json.loads(out)
  first = alone[1].index(stop)
  assert row["tokens"] == alone[1][:first + 1] and row["finish_reason"] == "stop"
  assert row["text"] == bytes(alone[1][:first]).decode("utf-8", errors="replace")


def test_sampling_by_seed_and_under_a_mesh(run_dir, capsys):
  """Same seed, same tokens; top-k 1 is greedy; a data x tensor mesh gives the greedy tokens
  of one device (float64: rounding cannot flip an argmax), with the pools in one shard or in
  a shard per data device."""
  base = [run_dir, "--prompt-ids", "1,2,3", "--prompt-ids", "7", "--max-new-tokens", "5",
          "--json", "--dtype", "float64"]
  tokens = lambda out: [r["tokens"] for r in sorted(map(json.loads, out.splitlines()),
                                                     key=lambda r: r["index"])]
  hot = ["--temperature", "1.5", "--seed", "4"]
  a, b = (tokens(generate(capsys, *base, *hot)[1]) for _ in range(2))
  greedy = tokens(generate(capsys, *base)[1])
  assert a == b
  assert tokens(generate(capsys, *base, *hot, "--top-k", "1")[1]) == greedy
  rc, out, _ = generate(capsys, *base, "--mesh", "data=-1,tensor=2")
  assert rc == 0 and tokens(out) == greedy
  # the pools in a shard per data device (4 slots for the 2 prompts: whole shards)
  rc, out, _ = generate(capsys, *base, "--mesh", "data=-1,tensor=2", "--data-shards", "4")
  assert rc == 0 and tokens(out) == greedy


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,999"], "outside the vocabulary"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "x", "--chat"], "chat_template"),
    (["--prompt-ids", "1", "--chat"], "--chat"),
    (["--prompt", "x", "--mesh", "data=3"], "--mesh"),
    (["--prompt", "x", "--stop", "ab"], "--stop"),
    (["--prompt", "x", "--mesh", "data=4,tensor=2", "--data-shards", "2"], "--data-shards"),
])
def test_bad_input_is_one_line(run_dir, capsys, args, message):
  rc, out, err = generate(capsys, run_dir, *args)
  assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and not out


def test_chat_template_is_rendered(tmp_path):
  from k3jax.generate import chat
  from k3jax.tokenizer import ByteTokenizer
  template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  path = chat.find_tokenizer_config([str(tmp_path)])
  text = chat.render(path, [{"role": "user", "content": "hi"}])
  assert text == "<|user|>hi<|end|>\n<|assistant|>"
  assert chat.encode(ByteTokenizer(), text) == list(text.encode())


def test_relative_paths_to_a_run_and_its_model(run_dir, capsys, monkeypatch):
  """The run folder and its model/ by paths relative to the working directory (Orbax itself
  takes only absolute ones): the same tokens as by the absolute path."""
  monkeypatch.chdir(os.path.dirname(run_dir))
  name = os.path.basename(run_dir)
  args = ["--prompt", "def f(x):", "--max-new-tokens", "4", "--dtype", "float64", "--json"]
  rows = []
  for model in (run_dir, name, os.path.join(name, "model")):
    rc, out, err = generate(capsys, model, *args)
    assert rc == 0, err
    rows.append(json.loads(out))
  assert rows[0] == rows[1] == rows[2]
