"""Items -> token arrays: what each worker process of `k3jax prepare-data` does.

An item (sources.py) becomes a document's ids, the tokenizer's end-of-document id appended
(none for a tokenizer without one: bytes), or a rejected row with its reason: bytes that are
not UTF-8, a line that is not JSON or not an object, a text field missing or not a string, a
null parquet value. Blank JSONL lines are skipped without a word. Special-token text inside a
document stays ordinary text, as in `k3jax train`'s text documents.

A worker loads the tokenizer once (`start_worker`) and encodes batches of items; a batch's
ids come back as one array with per-item lengths (cheap to send between processes).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from k3jax.corpus.sources import FILE_BYTES, JSON_LINE
from k3jax.folders import TokenizerSource
from k3jax.tokenizer import load_tokenizer

REJECTED, SKIPPED = -1, -2  # lengths of items that are not documents

_JSON_TYPES = {dict: "an object", list: "an array", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


@dataclasses.dataclass(frozen=True)
class EncodeSpec:
  tokenizer: TokenizerSource
  text_field: str
  dtype: str   # of the stored ids: uint8, uint16 or uint32 (manifest.token_dtype)


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A batch of items encoded: `tokens` holds the documents' ids back to back; `lengths[i]`
  is item i's count, or REJECTED (reason in `reasons[i]`) or SKIPPED."""
  tokens: np.ndarray
  lengths: np.ndarray
  reasons: dict[int, str]


class Rejected(Exception):
  pass


def text_of(kind: str, payload, field: str) -> str | None:
  """The document text of an item; None: nothing (a blank line). Raises Rejected."""
  if kind == FILE_BYTES:
    return _utf8(payload)
  if kind == JSON_LINE:
    if not payload.strip():
      return None
    try:
      row = json.loads(_utf8(payload))
    except ValueError as e:
      raise Rejected(f"not JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(row, dict):
      raise Rejected(f"not a JSON object but {_JSON_TYPES.get(type(row), 'a value')}")
    if field not in row:
      raise Rejected(f"no field {field!r}")
    value = row[field]
    if not isinstance(value, str):
      raise Rejected(f"field {field!r} is {_JSON_TYPES.get(type(value), 'not text')}, "
                     "not a string")
    return value
  if payload is None:
    raise Rejected("null value")
  return payload


def _utf8(data: bytes) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise Rejected(f"not UTF-8 (byte {e.start})") from None


def encode(tok, spec: EncodeSpec, items) -> Encoded:
  """Encode (kind, payload) items with `tok`."""
  eos = [] if tok.eos_id is None else [tok.eos_id]
  parts, lengths, reasons = [], np.empty(len(items), np.int64), {}
  for i, (kind, payload) in enumerate(items):
    try:
      text = text_of(kind, payload, spec.text_field)
    except Rejected as e:
      lengths[i], reasons[i] = REJECTED, str(e)
      continue
    if text is None:
      lengths[i] = SKIPPED
      continue
    ids = np.concatenate([tok.encode(text, allow_special=False), np.asarray(eos, np.int32)])
    parts.append(ids.astype(spec.dtype))
    lengths[i] = len(ids)
  tokens = np.concatenate(parts) if parts else np.zeros(0, spec.dtype)
  return Encoded(tokens, lengths, reasons)


_worker: tuple | None = None  # (tokenizer, spec) of this worker process


def start_worker(spec: EncodeSpec) -> None:
  global _worker
  _worker = (load_tokenizer(spec.tokenizer.kind, spec.tokenizer.folder), spec)


def encode_in_worker(items) -> Encoded:
  tok, spec = _worker
  return encode(tok, spec, items)
