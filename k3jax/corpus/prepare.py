"""`k3jax prepare-data`: raw sources -> a prepared dataset (ArrayRecord shards of token arrays
+ manifest.json), tokenized in worker processes, resumable.

The main process reads items (sources.py) in order and hands them to the workers in batches
of at most `batch_items` items or `batch_bytes` bytes, keeping at most two batches per worker
in flight; results come back in submission order, so the shards are the same whatever the
worker count. Memory is bounded by those batches (and by one text file, a document of its
own), never by the corpus. Documents fill shard 0, 1, ... in order; a shard closes once it
holds `shard_tokens` tokens (whole documents: the last may pass the mark), and the manifest
lists it only after it is closed, hashed and renamed into place (manifest.py).

Resume: running the same command again continues after the last listed shard: files not in
the manifest (a shard being written when the run died) are removed, rejected.jsonl is cut
back to what the listed shards account for, and reading restarts at the item after the last
listed shard's last one. Interrupted and resumed, the shards come out byte for byte as in one
uninterrupted run.

Rejected rows (encode.py) are skipped, counted, the first few printed and all of them written
to OUT/rejected.jsonl as {"source", "line" | "row", "reason"}; `strict` refuses the run at the
first one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time

from tqdm import tqdm

from k3jax.corpus import encode as encode_lib
from k3jax.corpus import manifest as manifest_lib
from k3jax.corpus import sources as sources_lib
from k3jax.corpus.holdout import held_out_count, held_out_every
from k3jax.corpus.shards import ShardWriter, token_dtype
from k3jax.errors import UserError
from k3jax.folders import TokenizerSource, tokenizer_source
from k3jax.tokenizer import load_tokenizer

PRINTED_REJECTIONS = 5


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  sources: tuple[str, ...]
  out: str
  tokenizer: str | None = None     # a model folder (its tokenizer) or "byte"; None: bytes
  text_field: str = "text"         # JSONL field / parquet column holding the text
  workers: int = 1                 # tokenizing processes (0: in this process)
  shard_tokens: int = 100_000_000  # a shard closes once it holds this many tokens
  strict: bool = False             # refuse the run at the first rejected row
  progress: bool = True
  batch_items: int = 1024
  batch_bytes: int = 4 << 20


def _tokenizer(kind: str | None) -> TokenizerSource:
  if kind in (None, "byte"):
    return TokenizerSource("byte", None)
  if not os.path.isdir(kind):
    raise UserError(f"--tokenizer {kind}: no such folder (a model folder, or byte)")
  return tokenizer_source("auto", kind)


def _end_of_document(tok) -> str:
  if tok.eos_id is None:
    return f"none: the {tok.name} tokenizer has no end-of-document token"
  return f"id {tok.eos_id} ({tok.decode_bytes([tok.eos_id]).decode()}) appended to every document"


def _fresh_manifest(opts: PrepareOptions, tok, files) -> dict:
  return {
      "format": manifest_lib.FORMAT, "format_version": manifest_lib.FORMAT_VERSION,
      "complete": False,
      "tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint,
                    "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
      "end_of_document": _end_of_document(tok), "token_dtype": token_dtype(tok.vocab_size),
      "text_field": opts.text_field, "shard_tokens": opts.shard_tokens,
      "sources": [f.to_dict() for f in files], "shards": [], "documents": 0, "tokens": 0,
      "rejected": 0, "rejected_bytes": 0, "next": [0, 0], "held_out": None}


def _check_resumable(out: str, old: dict, new: dict) -> None:
  for key, flag in (("sources", "SRC"), ("tokenizer", "--tokenizer"),
                    ("text_field", "--text-field"), ("shard_tokens", "--shard-tokens")):
    if old.get(key) != new[key]:
      raise UserError(f"{out} holds a prepare with other {flag} ({key} differ); use a new "
                      "--out, or the same arguments to resume it")


def _start(opts: PrepareOptions, tok, files) -> dict:
  """The manifest to continue from: a fresh one (the sources checked first, nothing written
  before that), or the folder's own, its folder cleaned of what it does not list."""
  out = opts.out
  fresh = _fresh_manifest(opts, tok, files)
  if manifest_lib.is_prepared(out):
    old = manifest_lib.read(out)
    _check_resumable(out, old, fresh)
    if not old["complete"]:
      _clean(out, old)
    return old
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise UserError(f"--out {out}: exists and is not a prepared dataset; use a new folder")
  for f in files:
    sources_lib.check(f, opts.text_field)
  os.makedirs(out, exist_ok=True)
  open(os.path.join(out, manifest_lib.REJECTED_FILE), "wb").close()
  return manifest_lib.write(out, fresh)


def _clean(out: str, manifest: dict) -> None:
  keep = {manifest_lib.FILE, manifest_lib.REJECTED_FILE} | {s["file"] for s in manifest["shards"]}
  for name in os.listdir(out):
    if name not in keep:
      os.remove(os.path.join(out, name))
  with open(os.path.join(out, manifest_lib.REJECTED_FILE), "ab") as f:
    f.truncate(manifest["rejected_bytes"])


def _items(files, text_field: str, start: tuple[int, int]):
  """(source index, position, kind, payload) from `start` on."""
  for si in range(start[0], len(files)):
    for pos, kind, payload in sources_lib.items(files[si], text_field,
                                                start[1] if si == start[0] else 0):
      yield si, pos, kind, payload


def _batches(items, max_items: int, max_bytes: int):
  """Lists of items, each under both limits (a single larger item goes alone)."""
  batch, size = [], 0
  for item in items:
    batch.append(item)
    size += len(item[3]) if isinstance(item[3], (bytes, str)) else 8
    if len(batch) >= max_items or size >= max_bytes:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def _encoded_in_order(batches, encode, pool, window: int):
  """(batch, Encoded) in submission order, at most `window` batches in flight."""
  if pool is None:
    for batch in batches:
      yield batch, encode([(b[2], b[3]) for b in batch])
    return
  pending = collections.deque()
  for batch in batches:
    pending.append((batch, pool.submit(encode_lib.encode_in_worker,
                                       [(b[2], b[3]) for b in batch])))
    if len(pending) >= window:
      head, future = pending.popleft()
      yield head, future.result()
  while pending:
    head, future = pending.popleft()
    yield head, future.result()


class _Writer:
  """Documents into shards, rejections into rejected.jsonl, commits into the manifest."""

  def __init__(self, out: str, files, manifest: dict, *, strict: bool = False):
    self.out, self.files, self.manifest, self.strict = out, files, manifest, strict
    self.shard: ShardWriter | None = None
    self.rejected = open(os.path.join(out, manifest_lib.REJECTED_FILE), "ab")
    self.added_documents = self.added_tokens = 0

  def document(self, ids, si: int, pos: int) -> None:
    if self.shard is None:
      self.shard = ShardWriter(self.out, len(self.manifest["shards"]),
                               self.manifest["token_dtype"])
    self.shard.write(ids)
    self.added_documents += 1
    self.added_tokens += len(ids)
    if self.shard.tokens >= self.manifest["shard_tokens"]:
      self.commit([si, pos + 1])

  def reject(self, si: int, pos: int, reason: str) -> None:
    place = sources_lib.where(self.files[si], pos)
    if self.strict:
      raise UserError(f"{sources_lib.describe(place)}: {reason} (--strict: no row is skipped)")
    self.rejected.write((json.dumps({**place, "reason": reason}) + "\n").encode())
    n = self.manifest["rejected"] = self.manifest["rejected"] + 1
    if n <= PRINTED_REJECTIONS:
      print(f"k3jax prepare-data: rejected {sources_lib.describe(place)}: {reason}"
            + (f" (the others: only in {self.rejected.name})" if n == PRINTED_REJECTIONS else ""),
            file=sys.stderr, flush=True)

  def commit(self, position: list[int], *, complete: bool = False) -> None:
    """List the open shard (if any) and the rejections so far, with `position` as where a
    resumed run continues."""
    m = self.manifest
    if self.shard is not None and self.shard.documents:
      entry = {**self.shard.finish(), "end": position}
      m["shards"].append(entry)
      m["documents"] += entry["documents"]
      m["tokens"] += entry["tokens"]
    elif self.shard is not None:
      self.shard.abort()
    self.shard = None
    self.rejected.flush()
    os.fsync(self.rejected.fileno())
    m["rejected_bytes"] = self.rejected.tell()
    m["next"] = position
    if complete:
      every = held_out_every(m["documents"])
      m["complete"] = True
      m["held_out"] = {"every": every, "documents": held_out_count(m["documents"], every)}
    self.manifest = manifest_lib.write(self.out, m)

  def close(self) -> None:
    if self.shard is not None:  # interrupted: the open shard was never listed
      self.shard.abort()
      self.shard = None
    self.rejected.close()


def _run(opts: PrepareOptions, files, tok, source: TokenizerSource, writer: _Writer) -> None:
  spec = encode_lib.EncodeSpec(source, opts.text_field, writer.manifest["token_dtype"])
  pool = None if opts.workers == 0 else concurrent.futures.ProcessPoolExecutor(
      opts.workers, mp_context=multiprocessing.get_context("spawn"),
      initializer=encode_lib.start_worker, initargs=(spec,))
  items = _items(files, opts.text_field, tuple(writer.manifest["next"]))
  batches = _batches(items, opts.batch_items, opts.batch_bytes)
  bar = tqdm(unit=" docs", unit_scale=True, disable=not opts.progress, dynamic_ncols=True)
  start = time.perf_counter()
  try:
    def encode(batch):  # --workers 0: in this process
      return encode_lib.encode(tok, spec, batch)

    for batch, enc in _encoded_in_order(batches, encode, pool, 2 * max(opts.workers, 1)):
      at = 0
      for i, (si, pos, _, _) in enumerate(batch):
        n = int(enc.lengths[i])
        if n == encode_lib.REJECTED:
          writer.reject(si, pos, enc.reasons[i])
        elif n >= 0:
          writer.document(enc.tokens[at:at + n], si, pos)
          at += n
      bar.update(int((enc.lengths >= 0).sum()))
      rate = writer.added_tokens / max(time.perf_counter() - start, 1e-9)
      bar.set_postfix_str(f"{rate:,.0f} tokens/s, {len(writer.manifest['shards'])} shards, "
                          f"{writer.manifest['rejected']} rejected", refresh=False)
    writer.commit([len(files), 0], complete=True)
  finally:
    bar.close()
    if pool is not None:
      pool.shutdown(cancel_futures=True)


def write_documents(out: str, documents, tok, shard_tokens: int) -> dict:
  """A prepared dataset of token arrays given directly (benchmarks and tests: no sources, no
  tokenizing); `tok`'s fingerprint, vocabulary and end-of-document id go in the manifest as
  they are (the arrays are stored as given). Returns the manifest."""
  opts = PrepareOptions(sources=(), out=out, shard_tokens=shard_tokens)
  os.makedirs(out)
  open(os.path.join(out, manifest_lib.REJECTED_FILE), "wb").close()
  writer = _Writer(out, [], manifest_lib.write(out, _fresh_manifest(opts, tok, [])))
  try:
    for i, ids in enumerate(documents):
      writer.document(ids, 0, i)
    writer.commit([0, 0], complete=True)
  finally:
    writer.close()
  return writer.manifest


def prepare(opts: PrepareOptions) -> dict:
  """Prepare (or finish preparing) `opts.out`; a summary of the dataset and of this run."""
  if opts.workers < 0 or opts.shard_tokens < 1:
    raise UserError("--workers must be >= 0 and --shard-tokens >= 1")
  opts = dataclasses.replace(opts, out=os.path.abspath(opts.out))
  source = _tokenizer(opts.tokenizer)
  tok = load_tokenizer(source.kind, source.folder)
  files = sources_lib.expand(opts.sources)
  manifest = _start(opts, tok, files)
  resumed = len(manifest["shards"]) if manifest["next"] != [0, 0] else None
  start = time.perf_counter()
  if not manifest["complete"]:
    writer = _Writer(opts.out, files, manifest, strict=opts.strict)
    try:
      _run(opts, files, tok, source, writer)
    finally:
      writer.close()
    manifest = writer.manifest
    added = (writer.added_documents, writer.added_tokens)
  else:
    added = (0, 0)
  seconds = time.perf_counter() - start
  return {"out": opts.out, "documents": manifest["documents"], "tokens": manifest["tokens"],
          "shards": len(manifest["shards"]), "rejected": manifest["rejected"],
          "end_of_document": manifest["end_of_document"],
          "fingerprint": manifest["fingerprint"], "resumed_after_shards": resumed,
          "added_documents": added[0], "added_tokens": added[1], "seconds": seconds,
          "documents_per_s": added[0] / seconds if seconds else None,
          "tokens_per_s": added[1] / seconds if seconds else None}
