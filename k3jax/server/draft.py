"""`--draft`: where a server's speculative drafts come from (docs/serving.md).

    --draft ngram                 prompt lookup: no weights
    --draft MODEL_DIR             a model folder k3jax loads, with the served model's tokenizer
    --num-draft-tokens K          drafts verified per request and step (1 .. page size)

Checked at start-up (one line naming the problem): K, a draft folder that exists, a
vocabulary of the served model's size and the same tokenizer (the same BPE ranks and special
tokens, or both bytes). The draft's weights load with the served model's, in the engine thread.
"""

from __future__ import annotations

import os

import configs
from k3jax.engine.drafts import ModelDrafter, NgramDrafter
from k3jax.engine.speculative import DraftRunner
from k3jax.errors import UserError
from k3jax.folders import model_folder
from k3jax.run.model import load_for_serving
from k3jax.tokenizer import text_tokenizer

NGRAM = "ngram"


def tokenizer_difference(a, b) -> str | None:
  """Why two tokenizers would not give the same ids, or None when they do."""
  if type(a) is not type(b):
    return f"{getattr(a, 'name', type(a).__name__)} against {getattr(b, 'name', type(b).__name__)}"
  if a.vocab_size != b.vocab_size:
    return f"{a.vocab_size} ids against {b.vocab_size}"
  if getattr(a, "special_tokens", {}) != getattr(b, "special_tokens", {}):
    return "different special tokens"
  spec_a, spec_b = getattr(a, "spec", None), getattr(b, "spec", None)
  if spec_a is not None and spec_b is not None:
    with open(spec_a.ranks_file, "rb") as fa, open(spec_b.ranks_file, "rb") as fb:
      if fa.read() != fb.read():
        return "different BPE ranks"
  return None


def check_draft(draft: str, k: int, cfg, tokenizer, page_size: int, data_shards: int,
                context_shards: int = 1) -> None:
  """UserError naming what makes `--draft` unusable with this model."""
  if not 1 <= k <= page_size:
    raise UserError(f"--num-draft-tokens must be in [1, {page_size}] (the page size), got {k}")
  if data_shards != 1:
    raise UserError("--draft serves one pool: use --data-shards 1")
  if context_shards != 1:
    raise UserError(f"--draft verifies drafts on pages held whole by every device: a mesh "
                    f"with context={context_shards} spreads them by position; leave out --draft "
                    f"or the context axis")
  if draft == NGRAM:
    return
  if not os.path.exists(draft):
    raise UserError(f"--draft {draft}: no such model folder (or use --draft ngram)")
  folder = model_folder(draft)
  other = configs.resolve(folder.weights)
  if other.vocab_size != cfg.vocab_size:
    raise UserError(f"--draft {draft}: a vocabulary of {other.vocab_size} ids, the model's has "
                    f"{cfg.vocab_size}")
  theirs = text_tokenizer(folder.tokenizer, other.vocab_size)
  why = None if tokenizer is None and theirs is None else (
      "one of the two has none" if tokenizer is None or theirs is None
      else tokenizer_difference(tokenizer, theirs))
  if why:
    raise UserError(f"--draft {draft}: its tokenizer differs from the model's ({why})")


def make_drafter(draft: str | None, k: int, engine_config, dtype: str, mesh,
                 experts: str | None):
  """The engine's drafter (None without --draft); loads a draft model's weights as the served
  model's load (run.model.load_for_serving: `dtype`, `mesh`, `--experts`)."""
  if draft is None:
    return None
  if draft == NGRAM:
    return NgramDrafter(k)
  model, _ = load_for_serving(model_folder(draft), dtype, mesh, experts)
  return ModelDrafter(DraftRunner(model, engine_config, mesh), k)
