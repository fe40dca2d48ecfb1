"""Argument helpers shared by the commands: value parsers, the help formatter, error wrapping,
and the flags more than one command takes (`add_remat`, `add_lora`, `add_processes`,
`add_engine_flags`)."""

from __future__ import annotations

import argparse
import os

import jax

from k3jax.errors import CheckpointError
from k3jax.execution import Attention, Remat
from k3jax.model import lora
from k3jax.server import Experts, ServeOptions


def _bounded(kind, allow_zero: bool):
  def parse(text: str):
    value = kind(text)
    if value < 0 or (value == 0 and not allow_zero):
      raise argparse.ArgumentTypeError(f"must be {'>=' if allow_zero else '>'} 0, got {text}")
    return value
  parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
  return parse


positive_int = _bounded(int, allow_zero=False)
positive_float = _bounded(float, allow_zero=False)
nonneg_int = _bounded(int, allow_zero=True)
nonneg_float = _bounded(float, allow_zero=True)


def optional_float(text: str) -> float | None:
  """A float, or none / off / 0 for "not set"."""
  return None if text.lower() in ("none", "off", "0") else float(text)


def token_ids(text: str) -> list[int]:
  """'1,2,3' or '1 2 3' -> [1, 2, 3]."""
  try:
    ids = [int(t) for t in text.replace(",", " ").split()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a list of token ids: {text!r}") from None
  if not ids:
    raise argparse.ArgumentTypeError("empty token id list")
  return ids


class Formatter(argparse.RawDescriptionHelpFormatter):
  """The module docstring as written; options show their default when they have one."""

  def _get_help_string(self, action):
    text = action.help or ""
    if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
      text += " (default: %(default)s)"
    return text


def default_compile_cache() -> str:
  """JAX's own JAX_COMPILATION_CACHE_DIR when set, else ~/.cache/k3jax/xla."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "k3jax", "xla")


def io_errors_are_user_errors(fn):
  """A full disk or an unreadable file is reported as one line too (nothing half-written
  stays behind either way: see convert/outdir.py)."""
  def run(args):
    try:
      return fn(args)
    except OSError as e:
      where = f"{e.filename}: " if e.filename else ""
      raise CheckpointError(f"{where}{e.strerror or e}") from None
  return run


def add_processes(parser, *, what: str, compiled: str | None = None) -> None:
  """--coordinator HOST:PORT --num-processes N --process-id I: one of several processes
  (hosts) of a run, as sharding.distributed.initialize takes them (`k3jax train`, `rl`,
  `convert`); `what` says what each process does. With `compiled` (what a process compiles
  before the first collective), also --startup-timeout."""
  parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help=f"multi-process ({what}): process 0's address (auto: "
                      "jax.distributed's own detection, e.g. Cloud TPU)")
  parser.add_argument("--num-processes", type=positive_int, default=None, metavar="N",
                      help="multi-process: how many processes (with --coordinator HOST:PORT)")
  parser.add_argument("--process-id", type=int, default=None, metavar="I",
                      help="multi-process: this process, 0 .. --num-processes - 1")
  if compiled:
    parser.add_argument("--startup-timeout", type=positive_float, default=3600.0,
                        metavar="SECONDS",
                        help=f"multi-process: how long a process waits for the others to "
                             f"compile {compiled} before the first collective")


def add_remat(parser, *, default: str | None, bare: str | None = None) -> None:
  """--remat POLICY (execution.Remat), as `k3jax train` runs it and `k3jax plan` plans it; the
  default is the command's, and `bare` (if any) is what a bare --remat means."""
  extra = {"nargs": "?", "const": bare} if bare else {}
  parser.add_argument(
      "--remat", default=default, choices=[r.value for r in Remat], **extra,
      help="rematerialisation policy per layer: none keeps every activation, full recomputes "
           "the layer from its input, save-attention the same but keeps MLA's flash attention "
           "output (needs --attention flash), save-dots keeps the projections' outputs, "
           "offload keeps them in host memory" + (f" (bare --remat: {bare})" if bare else "")
           + ("" if default else " (none given: none)"))


def add_step_knobs(parser, *, whole: str, searched: bool = False) -> None:
  """--loss-chunk, --attention, --capacity-factor: how a train step computes, as `k3jax train`
  runs it and `k3jax plan` plans it (`whole`: the --loss-chunk value for whole logits;
  `searched`: no flag means the plan chooses)."""
  unset = "none given: chosen by the plan" if searched else None
  parser.add_argument("--loss-chunk", type=nonneg_int, default=None, metavar="N",
                      help=f"positions per loss chunk ({whole}"
                           + ("" if searched else " or none given") + ": whole logits"
                           + (f"; {unset}" if searched else "") + ")")
  parser.add_argument("--attention", choices=[a.value for a in Attention], default=None,
                      help=f"MLA attention in training ({unset or 'none given: dense'})")
  parser.add_argument("--capacity-factor", type=nonneg_float, default=None, metavar="F",
                      help="routed experts' capacity factor (0" + ("" if searched else
                           " or none given") + ": dropless, whose receive buffers are sized "
                           "for the worst case" + (f"; {unset}" if searched else "") + ")")


def add_lora(parser, *, rank: int | None, base_experts: str, when: str = "") -> None:
  """--lora RANK, --lora-targets PATTERN..., --base-experts float|mxfp4: LoRA fine-tuning over a
  frozen base (k3jax/model/lora.py), as `k3jax train` runs it and `k3jax plan --mode lora`
  plans it. The defaults are the command's; `when` prefixes each help ("--mode lora: ")."""
  parser.add_argument(
      "--lora", type=int, default=rank, metavar="RANK",
      help=f"{when}LoRA adapters of this rank on the targets; the base stays frozen and holds "
           "no optimizer state")
  parser.add_argument(
      "--lora-targets", nargs="+", default=None, metavar="PATTERN",
      help=f"{when}fnmatch patterns over projection paths (none given: "
           f"{' '.join(lora.DEFAULT_TARGETS)}; moe.experts.* adds one adapter per routed expert; "
           "paths look like mla.q_b_proj, kda.o_proj, moe.shared_experts.up_proj, "
           "moe.routed_down, moe.experts.w1)")
  parser.add_argument(
      "--base-experts", choices=("float", "mxfp4"), default=base_experts,
      help=f"{when}the frozen routed experts in memory: float (bf16) or mxfp4 (MXFP4 codes, "
           "dequantised per matmul)")


DTYPES = ("auto", "float64", "float32", "bfloat16")


def add_tokenizer_flag(p: argparse.ArgumentParser) -> None:
  """--tokenizer FOLDER for the commands that serve text over the engine (serve, eval)."""
  p.add_argument("--tokenizer", metavar="FOLDER", default=None,
                 help="a folder with tiktoken.model (and its chat template), or byte "
                      "(default: the model folder's own, or the one a `k3jax train` run used)")


def add_engine_flags(p: argparse.ArgumentParser, *, max_num_seqs: int,
                     decode_steps: int = 1) -> None:
  """The flags of a model run on the engine (`k3jax generate`, `serve`, `eval`): how it loads
  and the engine's sizes. The defaults of --max-num-seqs and --decode-steps are the
  command's."""
  p.add_argument("--mesh", metavar="MESH", help="device mesh, e.g. data=2,tensor=4")
  p.add_argument("--dtype", choices=DTYPES, default="auto",
                 help="auto: float32 on CPU, bfloat16 on TPU/GPU")
  p.add_argument("--experts", choices=[e.value for e in Experts], default=None,
                 help="routed experts at run time: packed MXFP4 codes + scales, or dequantized "
                      "to --dtype as they load (default: as the folder stores them)")
  p.add_argument("--max-num-seqs", type=positive_int, default=max_num_seqs,
                 help="requests computed at once (each holds a KDA state); the rest wait")
  p.add_argument("--max-model-len", type=positive_int, default=None,
                 help="the longest sequence (prompt + output) a request may reach (default: the "
                 "folder's max_position_embeddings / model_max_length, else 8192)")
  p.add_argument("--prefill-chunk", type=positive_int, default=512,
                 help="prompt tokens per prefill row of an engine step")
  p.add_argument("--prefill-widths", type=positive_int, default=1, metavar="N",
                 help="prefill row widths compiled: --prefill-chunk and its halves, N in all "
                      "(a short prompt runs in a narrower row instead of a padded chunk)")
  p.add_argument("--prefill-rows", type=positive_int, default=1, metavar="N",
                 help="prompts read per engine step, at most (each a row of up to "
                      "--prefill-chunk tokens; a step compiles 1, 2, 4, ... rows as it needs)")
  p.add_argument("--decode-steps", type=positive_int, default=decode_steps, metavar="N",
                 help="decode steps per engine call while no prompt is being read (one "
                      "jitted loop; a request that arrives meanwhile waits for it to end)")
  p.add_argument("--data-shards", type=positive_int, default=1, metavar="N",
                 help="split the slot, page and snapshot pools into N shards; with --mesh "
                      "they split over the batch axes (data x fsdp x expert), each device "
                      "serving its own shards' requests (N: a multiple of those devices; "
                      "--max-num-seqs divides by it)")
  p.add_argument("--prefix-state-every", type=positive_int, default=4, metavar="K",
                 help="prefix cache: a KDA state snapshot every K cached blocks")
  p.add_argument("--compile-cache", default=default_compile_cache(),
                 help="persistent XLA compilation cache folder (none: off)")


def add_draft_flags(p: argparse.ArgumentParser) -> None:
  """Speculative decoding's flags (`k3jax serve`, `k3jax eval`)."""
  p.add_argument("--draft", metavar="MODEL_DIR|ngram", default=None,
                 help="speculative decoding: draft tokens from this model folder (the served "
                      "model's tokenizer) or from prompt lookup (ngram); greedy output is "
                      "unchanged, sampled output keeps its distribution")
  p.add_argument("--num-draft-tokens", type=positive_int, default=4, metavar="K",
                 help="with --draft: drafts verified per request and step (1 .. page size 64)")


def use_compile_cache(folder: str) -> None:
  """--compile-cache: JAX's persistent compilation cache in `folder` (none: off)."""
  if folder.lower() != "none":
    jax.config.update("jax_compilation_cache_dir", folder)


def engine_options(args: argparse.Namespace, **fields):
  """ServeOptions from the flags of `add_engine_flags` (plus `fields`); sets the compilation
  cache."""
  use_compile_cache(args.compile_cache)
  return ServeOptions(model=args.model, tokenizer=args.tokenizer, mesh=args.mesh,
                      dtype=args.dtype,
                      experts=Experts(args.experts) if args.experts else None,
                      max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                      prefill_chunk=args.prefill_chunk, prefill_widths=args.prefill_widths,
                      prefill_rows=args.prefill_rows, decode_steps=args.decode_steps,
                      prefix_state_every=args.prefix_state_every,
                      data_shards=args.data_shards, draft=getattr(args, "draft", None),
                      num_draft_tokens=getattr(args, "num_draft_tokens", 4), **fields)
