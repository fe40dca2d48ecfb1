"""`--data-mix mix.json`: a weighted mixture of prepared datasets.

    {"components": [{"path": "data/web", "weight": 0.7}, {"path": "data/code", "weight": 0.3}],
     "shares": "documents"}

`path`: a prepared dataset folder (relative paths are taken from the mix file's folder);
`weight` >= 0, not all zero (normalised); `shares` (optional): "documents" (the default) or
"tokens". The weights are shares of documents: the trainer draws documents from the
components in a fixed interleave (below), so after n draws component c has given
n * w_c documents within c + 1 (exactly, not in expectation). With "tokens" each weight is
divided by its component's mean document length first, so the token shares are w in
expectation.

The interleave (`counts`, `pick`): the weights become exact integer proportions p_0..p_C-1
(sum P); among the first k draws component 0 gives k - floor(k (P - p_0) / P), and the
remaining draws split the same way among the others, recursively. Each step of the
recursion is a two-way split whose counts grow by 0 or 1 per draw, so every k has exactly
one component and draw k is random-access (O(C)), as a Grain map dataset needs.
"""

from __future__ import annotations

import dataclasses
import fractions
import hashlib
import json
import math
import os
from collections.abc import Sequence

from k3jax.corpus import manifest as manifest_lib
from k3jax.errors import UserError

SHARES = ("documents", "tokens")


@dataclasses.dataclass(frozen=True)
class Mixture:
  paths: tuple[str, ...]      # absolute prepared-dataset folders
  weights: tuple[float, ...]
  shares: str = "documents"
  file: str | None = None     # the mix file (None: one --data folder)

  @property
  def content_hash(self) -> str:
    """What the mixture says (absolute paths, weights, shares): a resume refuses another."""
    text = json.dumps({"paths": self.paths, "weights": self.weights, "shares": self.shares},
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def single(path: str) -> Mixture:
  return Mixture((os.path.abspath(path),), (1.0,))


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read(path: str) -> Mixture:
  """The mixture in `path`, each component checked to be a prepared dataset."""
  raw = manifest_lib.read_json(path, f"--data-mix {path}")
  if not isinstance(raw, dict) or not isinstance(raw.get("components"), list) \
      or not raw["components"]:
    raise UserError(f"{path}: expected {{\"components\": [{{\"path\": DIR, \"weight\": w}}, "
                    "...]}")
  if set(raw) - {"components", "shares"}:
    raise UserError(f"{path}: unknown key(s) {sorted(set(raw) - {'components', 'shares'})}")
  shares = raw.get("shares", "documents")
  if shares not in SHARES:
    raise UserError(f"{path}: shares {shares!r}: expected documents or tokens")
  root = os.path.dirname(os.path.abspath(path))
  paths, weights = [], []
  for i, c in enumerate(raw["components"]):
    where = f"{path}: component {i}"
    if not isinstance(c, dict) or set(c) != {"path", "weight"}:
      raise UserError(f"{where}: expected {{\"path\": DIR, \"weight\": w}}, got {c!r}")
    if not isinstance(c["path"], str) or not _number(c["weight"]) or c["weight"] < 0:
      raise UserError(f"{where}: weight {c['weight']!r} (a number >= 0) and path (a string)")
    folder = os.path.normpath(os.path.join(root, c["path"]))
    if not os.path.isdir(folder):
      raise UserError(f"{where}: {folder}: no such folder")
    if not manifest_lib.is_prepared(folder):
      raise UserError(f"{where}: {folder} is not a prepared dataset (no {manifest_lib.FILE}; "
                      "k3jax prepare-data makes one)")
    paths.append(folder)
    weights.append(float(c["weight"]))
  if sum(weights) <= 0:
    raise UserError(f"{path}: the weights sum to 0")
  return Mixture(tuple(paths), tuple(weights), shares, os.path.abspath(path))


def proportions(weights: Sequence[float]) -> tuple[int, ...]:
  """Exact integer proportions of `weights` (each as a fraction of denominator <= 10^6)."""
  fracs = [fractions.Fraction(w).limit_denominator(10**6) for w in weights]
  scale = math.lcm(*(f.denominator for f in fracs))
  ints = [int(f * scale) for f in fracs]
  g = math.gcd(*ints)
  return tuple(i // g for i in ints)


def counts(k: int, props: Sequence[int]) -> list[int]:
  """How many of the first k draws each component gives."""
  out, rest, total = [], k, sum(props)
  for p in props:
    after = rest * (total - p) // total if total else 0
    out.append(rest - after)
    rest, total = after, total - p
  return out


def pick(k: int, props: Sequence[int]) -> tuple[int, int]:
  """(component, its draw number) of draw k."""
  before, after = counts(k, props), counts(k + 1, props)
  for c, (a, b) in enumerate(zip(before, after)):
    if b != a:
      return c, a
  raise AssertionError("every draw has a component")
