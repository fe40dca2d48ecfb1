"""`k3jax generate`: sample from a model folder on the serving engine (docs/serving.md).

MODEL is an official K3 / Kimi-Linear folder, a converted k3jax checkpoint, or a `k3jax train`
output folder (its `model/` weights and the run's tokenizer: bytes for the tiny preset). Text
prompts use the folder's tokenizer (`tiktoken.model`; bytes for a byte-level model) and, with
--chat, its chat template; --prompt-ids takes token ids. Several prompts (repeat --prompt /
--prompt-ids, or one per line of --prompt-file) are served together by the engine: up to
--max-num-seqs at once, each finishing on its own.

Output: one prompt streams its text (or ids) to stdout as tokens arrive; several prompts print
`[i] text` per prompt as each finishes; --json prints one object per prompt (index,
prompt_tokens, tokens, text, finish_reason) as each finishes. A stop token ends a row and is
kept in `tokens` but not in `text`. Timing goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax

from k3jax.commands._args import (
  Formatter,
  add_engine_flags,
  nonneg_float,
  nonneg_int,
  positive_int,
  token_ids,
  use_compile_cache,
)
from k3jax.engine import DEFAULT_MAX_MODEL_LEN, Engine, EngineConfig, SamplingParams, check_shards
from k3jax.errors import UserError
from k3jax.execution import resolve_dtype
from k3jax.folders import max_model_len
from k3jax.generate import chat
from k3jax.generate.chat import find_tokenizer_config
from k3jax.run.model import existing_folder, load_for_serving
from k3jax.tokenizer import text_tokenizer
from sharding.mesh import make_mesh


def _prompts(args, tokenizer, chat_config) -> list[list[int]]:
  if args.prompt_ids:
    if args.chat:
      raise UserError("--chat renders text prompts; it does not apply to --prompt-ids")
    return [list(p) for p in args.prompt_ids]
  if args.prompt_file:
    try:
      with open(args.prompt_file, encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
      raise UserError(f"--prompt-file: {e}") from None
    if not texts:
      raise UserError(f"--prompt-file {args.prompt_file}: no prompts (one per line)")
  else:
    texts = args.prompt
  if tokenizer is None:
    raise UserError("this model folder has no tokenizer (tiktoken.model) and is not "
                    "byte-level: pass --prompt-ids")
  if args.chat:
    return [chat.encode(tokenizer, chat.render(chat_config, [{"role": "user", "content": t}]))
            for t in texts]
  out = [[int(i) for i in tokenizer.encode(t)] for t in texts]
  if any(not p for p in out):
    raise UserError("an empty prompt: give at least one token")
  return out


def _stop_ids(args, cfg, tokenizer) -> list[int]:
  stops = [] if args.ignore_eos or cfg.eos_token_id is None else [int(cfg.eos_token_id)]
  for s in args.stop or ():
    if s.lstrip("-").isdigit():
      stops.append(int(s))
      continue
    ids = chat.encode(tokenizer, s) if tokenizer is not None else []
    if len(ids) != 1:
      raise UserError(f"--stop {s!r}: not a token id, nor text of exactly one token")
    stops.append(ids[0])
  return stops


class _Printer:
  """Streams one prompt's text, or prints each finished prompt (text or JSON)."""

  def __init__(self, args, prompts, tokenizer, stops):
    self.args, self.prompts, self.tok, self.stops = args, prompts, tokenizer, set(stops)
    self.rows = [[] for _ in prompts]
    self.shown = 0  # characters (or ids) of row 0 already streamed
    self.stream = len(prompts) == 1 and not args.json

  def text(self, ids) -> str | None:
    if self.tok is None:
      return None
    return self.tok.decode([t for t in ids if t not in self.stops])

  def add(self, b: int, new: list[int], finish_reason: str | None) -> None:
    self.rows[b].extend(new)
    if self.stream:
      self._stream(final=finish_reason is not None)
    if finish_reason is not None:
      self._finish(b, finish_reason)

  def _stream(self, final: bool) -> None:
    if self.tok is None:
      new = self.rows[0][self.shown:]
      piece = (" " if self.shown and new else "") + " ".join(map(str, new))
      self.shown += len(new)
    else:
      text = self.text(self.rows[0])
      if not final and text.endswith("\ufffd"):  # a character split across tokens: wait
        text = text[:-1]
      piece, self.shown = text[self.shown:], max(self.shown, len(text))
    sys.stdout.write(piece + ("\n" if final else ""))
    sys.stdout.flush()

  def _finish(self, b: int, reason: str) -> None:
    row = self.rows[b]
    if self.args.json:
      obj = {"index": b, "prompt_tokens": len(self.prompts[b]), "tokens": row,
             "finish_reason": reason}
      if self.tok is not None:
        obj["text"] = self.text(row)
      print(json.dumps(obj), flush=True)
    elif not self.stream:
      text = self.text(row)
      print(f"[{b}] " + (text if text is not None else " ".join(map(str, row))), flush=True)


def run(args: argparse.Namespace) -> int:
  if not 0 < args.top_p <= 1:
    raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
  use_compile_cache(args.compile_cache)
  dtype = resolve_dtype(args.dtype)
  folder = existing_folder(args.model)
  weights, source = folder.weights, folder.tokenizer
  mesh = make_mesh(args.mesh) if args.mesh else None
  if mesh is not None:  # before loading: a mesh the pools cannot split is refused at once
    try:
      check_shards(args.data_shards, mesh)
    except ValueError as e:
      raise UserError(f"--data-shards: {e}") from None
  with jax.enable_x64(dtype == "float64"):
    t0 = time.perf_counter()
    # placed on the mesh as loaded (a converted checkpoint straight into its shards)
    model, cfg = load_for_serving(folder, dtype, mesh, args.experts)
    tokenizer = text_tokenizer(source, cfg.vocab_size)
    prompts = _prompts(args, tokenizer, find_tokenizer_config([source.folder, weights]))
    bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
      raise UserError(f"token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
    stops = _stop_ids(args, cfg, tokenizer)
    print(f"{args.model}: {cfg.num_layers} layers, {dtype}, loaded in "
          f"{time.perf_counter() - t0:.1f}s; {len(prompts)} prompt(s) of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens", file=sys.stderr)
    config = engine_config(args, prompts, max_model_len(folder))
    _generate(args, model, prompts, tokenizer, stops, config, mesh)
  return 0


def engine_config(args, prompts: list[list[int]], limit: int | None) -> EngineConfig:
  """The engine for this command's prompts: a slot per prompt (up to --max-num-seqs), the
  model's maximum length (--max-model-len, else the folder's own, else 8192)."""
  max_len = args.max_model_len or limit or DEFAULT_MAX_MODEL_LEN
  longest = max(map(len, prompts))
  if longest > max_len:
    raise UserError(f"a prompt has {longest} tokens; the maximum model length is {max_len} "
                    "(--max-model-len)")
  shards = args.data_shards
  slots = -(-min(len(prompts), args.max_num_seqs) // shards) * shards  # whole shards
  try:
    return EngineConfig(max_num_seqs=slots, max_model_len=max_len,
                        prefill_chunk=args.prefill_chunk, prefill_widths=args.prefill_widths,
                        prefill_rows=args.prefill_rows, decode_steps=args.decode_steps,
                        prefix_state_every=args.prefix_state_every, data_shards=shards)
  except ValueError as e:
    raise UserError(str(e)) from None


def _generate(args, model, prompts, tokenizer, stops, config: EngineConfig, mesh) -> None:
  engine = Engine(model, config, mesh=mesh)
  printer = _Printer(args, prompts, tokenizer, stops)
  for i, p in enumerate(prompts):
    # stops holds the EOS already (unless --ignore-eos): the engine adds none of its own
    sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed + i,
                              stop_token_ids=tuple(stops), ignore_eos=True)
    try:
      engine.add(str(i), p, sampling)
    except ValueError as e:
      raise UserError(f"prompt {i}: {e}") from None
  t0, n_new = time.perf_counter(), 0
  while engine.has_work():
    for out in engine.step():
      printer.add(int(out.request_id), out.token_ids, out.finish_reason)
      n_new += len(out.token_ids)
  print(f"{n_new} new tokens in {time.perf_counter() - t0:.2f}s (compilation included), "
        f"{engine.steps} engine steps", file=sys.stderr)


def register(sub) -> None:
  p = sub.add_parser("generate", help="sample from a model (greedy, temperature, top-k/p)",
                     description=__doc__, formatter_class=Formatter)
  p.add_argument("model", metavar="MODEL",
                 help="official folder, converted checkpoint, or `k3jax train` output folder")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", action="append", metavar="TEXT", help="a text prompt (repeatable)")
  src.add_argument("--prompt-file", metavar="F", help="text prompts, one per line")
  src.add_argument("--prompt-ids", action="append", type=token_ids, metavar="1,2,3",
                   help="a prompt as token ids (repeatable)")
  p.add_argument("--chat", action="store_true",
                 help="wrap each text prompt as a user turn of the folder's chat template")
  p.add_argument("--max-new-tokens", type=nonneg_int, default=64)
  p.add_argument("--temperature", type=nonneg_float, default=0.0, help="0: greedy")
  p.add_argument("--top-k", type=nonneg_int, default=0, help="0: off")
  p.add_argument("--top-p", type=float, default=1.0, help="1: off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", nargs="+", metavar="TOKEN",
                 help="extra stop tokens: ids, or text of exactly one token")
  p.add_argument("--ignore-eos", action="store_true",
                 help="do not stop at the config's eos_token_id")
  p.add_argument("--json", action="store_true", help="one JSON object per prompt")
  p.add_argument("--block", type=positive_int, default=8,
                 help="kept for scripts; the engine streams every step (docs/serving.md)")
  add_engine_flags(p, max_num_seqs=64, decode_steps=8)
  p.set_defaults(func=run)
