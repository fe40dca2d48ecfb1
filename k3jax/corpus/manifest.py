"""`manifest.json` of a prepared dataset: what its shards hold, and what it was made from.

    {"format": "k3jax-prepared", "format_version": 1, "complete": true,
     "tokenizer": {"name", "fingerprint", "vocab_size", "eos_id"},
     "end_of_document": "id 163585 ([EOS]) appended to every document" | "none: ...",
     "token_dtype": "uint32", "text_field": "text", "shard_tokens": 100000000,
     "sources": [{"url", "kind"}, ...],
     "shards": [{"file", "documents", "tokens", "bytes", "sha256", "end": [source, item]}, ...],
     "documents", "tokens", "rejected", "rejected_bytes", "next": [source, item],
     "held_out": {"every", "documents"},
     "fingerprint": "..."}

A shard is listed only once whole and in place (prepare.py writes the manifest after the
shard, atomically), so what the manifest counts is never half-written; `end` / `next` say
where in the sources a resumed prepare continues, `rejected_bytes` how much of rejected.jsonl
belongs to the listed shards. `fingerprint` hashes what the data is (tokenizer, end-of-document
id, token type, every shard's counts, size and SHA-256, the hold-out): a training run records
it and a resume refuses a dataset prepared again; a manifest edited by hand no longer matches
its own fingerprint and is refused.
"""

from __future__ import annotations

import hashlib
import json
import os

from k3jax.errors import UserError

FILE = "manifest.json"
FORMAT = "k3jax-prepared"
FORMAT_VERSION = 1
REJECTED_FILE = "rejected.jsonl"

_IDENTITY = ("format", "format_version", "tokenizer", "token_dtype", "held_out")
_SHARD_IDENTITY = ("file", "documents", "tokens", "bytes", "sha256")


def is_prepared(path: str) -> bool:
  """A folder holding a manifest.json: a prepared dataset (finished or not)."""
  return os.path.isfile(os.path.join(path, FILE))


def fingerprint(manifest: dict) -> str:
  identity = {k: manifest.get(k) for k in _IDENTITY}
  identity["shards"] = [{k: s[k] for k in _SHARD_IDENTITY} for s in manifest["shards"]]
  text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def write(folder: str, manifest: dict) -> dict:
  """Write `manifest` (with its fingerprint) atomically: a reader sees the old one or this."""
  manifest = {**manifest, "fingerprint": fingerprint(manifest)}
  path = os.path.join(folder, FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)
  return manifest


def read_json(path: str, what: str | None = None):
  """The JSON value in `path`; a file that cannot be read or is not JSON is a UserError naming
  it (`what`, e.g. the flag that gave it; the path by default)."""
  try:
    with open(path) as f:
      return json.load(f)
  except OSError as e:
    raise UserError(f"{what or path}: {e.strerror}") from None
  except ValueError as e:
    raise UserError(f"{path}: not JSON ({e})") from None


def read(folder: str) -> dict:
  """The manifest of `folder`, checked against its own fingerprint (finished or not)."""
  path = os.path.join(folder, FILE)
  manifest = read_json(path)
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise UserError(f"{path}: not a k3jax prepared-dataset manifest")
  if manifest.get("format_version") != FORMAT_VERSION:
    raise UserError(f"{path}: format version {manifest.get('format_version')}, this k3jax "
                    f"reads {FORMAT_VERSION}")
  try:
    ok = fingerprint(manifest) == manifest.get("fingerprint")
  except (KeyError, TypeError):
    ok = False
  if not ok:
    raise UserError(f"{path}: its shard table does not match its fingerprint (edited by "
                    "hand?); prepare the dataset again")
  return manifest


def read_complete(folder: str) -> dict:
  """The manifest of a finished prepared dataset whose shards are all in place, whole: each
  listed file present with the size the manifest records (one stat each; the record counts
  are checked when a shard is first opened, shards.ShardReader)."""
  manifest = read(folder)
  if not manifest.get("complete"):
    raise UserError(f"{folder}: prepare-data has not finished ({len(manifest['shards'])} "
                    "shards so far); run the same prepare-data command again to finish it")
  for shard in manifest["shards"]:
    path = os.path.join(folder, shard["file"])
    try:
      size = os.path.getsize(path)
    except OSError:
      raise UserError(f"{path}: missing (listed in {FILE})") from None
    if size != shard["bytes"]:
      raise UserError(f"{path}: {size} bytes, {FILE} says {shard['bytes']} (truncated or "
                      "replaced); prepare the dataset again")
  counts = [sum(s[k] for s in manifest["shards"]) for k in ("documents", "tokens")]
  if counts != [manifest["documents"], manifest["tokens"]]:
    raise UserError(f"{os.path.join(folder, FILE)}: its shards hold {counts[0]} documents and "
                    f"{counts[1]} tokens, its totals say {manifest['documents']} and "
                    f"{manifest['tokens']}")
  return manifest
