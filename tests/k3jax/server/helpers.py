"""Model folders for the server tests, and a server started as `k3jax serve` starts it.

byte_run      a `k3jax train`-style output (run.json + model/) of a 2-layer byte-level model
chat_run      the same shape with a vocabulary of 163,840 ids and Moonshot's real K2 tokenizer
              (the K2-Thinking folder, tests/k3jax/tokenizer/real_files.py): a crafted model
              that, after `<|im_middle|>` (the end of a generation prompt), writes SCRIPT then
              `<|im_end|>`
start         the server for a folder from `k3jax serve` flags, in a thread, on a free port
request       a raw HTTP request (the standard library's client: bodies the `openai` client
              would refuse to send, status codes and headers as they are)

The crafted model: every token of the script is a distinct token id, and each maps to the next
one through its embedding row (a large random direction that dominates the residual stream)
and the head column of its successor (the same direction): a chain that greedy decoding and
sampling both follow whatever the layers add, while every other token keeps the random model's
behaviour.
"""

import contextlib
import http.client
import json
import os
import urllib.parse

import jax
import numpy as np
import openai
from flax import nnx
from tiktoken.load import load_tiktoken_bpe

from k3jax.cli import build_parser
from k3jax.commands._args import engine_options
from k3jax.model.transformer import K3Model
from k3jax.server import build
from k3jax.tokenizer import load_tokenizer
from k3jax.tokenizer.tool_calls import THINK_CLOSE
from k3jax.train.checkpoint import save_model
from k3jax.train.step import split_model
from tests.k3jax.model.helpers import randomize, tiny_cfg
from tests.k3jax.tokenizer.real_files import assemble

KEY = "test-key-0123456789"
COMMON = ["--dtype", "float64", "--compile-cache", "none", "--max-num-seqs", "4"]

# What the crafted chat model answers: reasoning, content whose "é" is split across two byte
# tokens, and one tool call. str: any tokens spelling it; bytes: exactly that one token.
SCRIPT = ["<think>", "The user wants the weather.", "</think>", "Checking the caf", b"\xc3",
          b"\xa9", ".", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
          "functions.get_weather:0", "<|tool_call_argument_begin|>", '{"city": "Paris"}',
          "<|tool_call_end|>", "<|tool_calls_section_end|>"]
REASONING, CONTENT = "The user wants the weather.", "Checking the café."
CALL = ("functions.get_weather:0", "get_weather", '{"city": "Paris"}')


def _save(out: str, model, cfg, tokenizer: str) -> str:
  graphdef, params, bias = split_model(model)
  save_model(os.path.join(out, "model"), graphdef, params, bias, cfg)
  with open(os.path.join(out, "run.json"), "w") as f:
    json.dump({"options": {"tokenizer": tokenizer, "init_from": None}, "model": cfg.to_dict()},
              f)
  return out


def _zeros(cfg):
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  for _, var in nnx.to_flat_state(nnx.state(model)):
    var.set_value(jax.numpy.zeros(var.shape, var.dtype))
  return model


def byte_run(out: str, seed: int = 2, tokenizer: str = "byte") -> str:
  cfg = tiny_cfg(vocab_size=256, num_layers=2, mla_layers=(1,))
  return _save(out, randomize(_zeros(cfg), seed, scale=3.0), cfg, tokenizer)


def packable_run(out: str) -> str:
  """byte_run's model with routed experts of whole MXFP4 groups (latent 32, F 64)."""
  cfg = tiny_cfg(vocab_size=256, num_layers=2, mla_layers=(1,), latent_size=32,
                 moe_intermediate_size=64)
  return _save(out, randomize(_zeros(cfg), 2, scale=3.0), cfg, "byte")


def script_ids(tok, script=SCRIPT) -> list[int]:
  """The script as distinct token ids: special-token text as its token, bytes as that one
  token, other text split into the longest tokens not used elsewhere (depth first; a token
  may span consecutive text pieces, but not the end of `</think>`)."""
  ranks = load_tiktoken_bpe(tok.spec.ranks_file)
  longest = max(map(len, ranks))
  pieces, alone = [], False
  for p in script:  # text runs between special tokens may share tokens across pieces, but
    # no token spans the end of "</think>" (a grammar enforcing the answer after reasoning
    # needs the reasoning to end where a token does)
    if isinstance(p, bytes) or p in tok.special_tokens:
      pieces.append([ranks[p]] if isinstance(p, bytes) else [tok.token_id(p)])
    elif pieces and isinstance(pieces[-1], bytes) and not alone:
      pieces[-1] += p.encode()
    else:
      pieces.append(p.encode())
    alone = p == THINK_CLOSE

  def spell(i: int, data: bytes, used: frozenset) -> list[int] | None:
    if not data:
      if i == len(pieces):
        return []
      nxt = pieces[i]
      if isinstance(nxt, list):
        rest = None if used & set(nxt) else spell(i + 1, b"", used | set(nxt))
        return None if rest is None else nxt + rest
      return spell(i + 1, nxt, used)
    for k in range(min(longest, len(data)), 0, -1):
      t = ranks.get(data[:k])
      if t is not None and t not in used:
        rest = spell(i, data[k:], used | {t})
        if rest is not None:
          return [t, *rest]
    return None

  ids = spell(0, b"", frozenset({tok.token_id("<|im_middle|>"), tok.token_id("<|im_end|>")}))
  assert ids is not None and len(set(ids)) == len(ids)
  return ids


def chat_run(out: str, reference_dir: str) -> tuple[str, str]:
  """(run folder, tokenizer folder)."""
  tok_dir = assemble(os.path.join(out, "tokenizer"), reference_dir, thinking=True)
  tok = load_tokenizer("auto", tok_dir)
  cfg = tiny_cfg(vocab_size=tok.vocab_size, num_layers=2, mla_layers=(1,),
                 attn_res_block_size=None, eos_token_id=tok.token_id("[EOS]"))
  model = randomize(_zeros(cfg), 3)
  chain = [tok.token_id("<|im_middle|>"), *script_ids(tok), tok.token_id("<|im_end|>")]
  rng = np.random.default_rng(0)
  u = rng.standard_normal((len(chain) - 1, cfg.hidden_size))
  u /= np.linalg.norm(u, axis=1, keepdims=True)
  embed, head = np.array(model.embed[...]), np.array(model.lm_head[...])
  embed[chain[:-1]] = 100.0 * u
  head[:, chain[1:]] = 10.0 * u.T
  model.embed.set_value(jax.numpy.asarray(embed))
  model.lm_head.set_value(jax.numpy.asarray(head))
  return _save(os.path.join(out, "run"), model, cfg, tok_dir), tok_dir


def start(folder: str, *flags: str, gate=None):
  """The server `k3jax serve FOLDER FLAGS` builds, started in a thread on a free port.
  `gate`: a threading.Event the weights wait for (to see the server while it loads)."""
  args = build_parser().parse_args(["serve", folder, *COMMON, *flags])
  server = build(engine_options(args, host="127.0.0.1", port=0, api_key=KEY,
                                served_model_name="tiny"))
  if gate is not None:
    load = server.service.loop.build
    server.service.loop.build = lambda: (gate.wait(), load())[1]
  return server.start()


@contextlib.contextmanager
def serving(folder: str, *flags: str):
  """A started server (as `start`) once its weights are loaded; stopped on the way out."""
  server = start(folder, *flags)
  try:
    server.wait_ready(300)
    yield server
  finally:
    server.stop()


def openai_client(server) -> openai.OpenAI:
  """The OpenAI client users point at the server: no retries, so a failure shows at once."""
  return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


class Response:
  def __init__(self, status: int, headers, body: bytes):
    self.status_code, self.headers, self.content = status, headers, body

  @property
  def text(self) -> str:
    return self.content.decode()

  def json(self):
    return json.loads(self.content)


def connect(url: str, method: str, path: str, body=None, *, key: str | None = KEY,
            content: bytes | None = None, timeout: float = 300):
  """(connection, response) of a request whose body is not read yet (streams)."""
  where = urllib.parse.urlsplit(url)
  conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
  headers = {"Content-Type": "application/json"}
  if key is not None:
    headers["Authorization"] = f"Bearer {key}"
  data = content if content is not None else None if body is None else json.dumps(body).encode()
  conn.request(method, path, body=data, headers=headers)
  return conn, conn.getresponse()


def request(url: str, method: str, path: str, body=None, *, key: str | None = KEY,
         content: bytes | None = None, timeout: float = 300) -> Response:
  conn, r = connect(url, method, path, body, key=key, content=content, timeout=timeout)
  try:
    return Response(r.status, r.headers, r.read())
  finally:
    conn.close()
