"""`k3jax prepare-data`: raw text sources -> a prepared dataset `k3jax train --data DIR` reads
(docs/training.md#data-at-scale).

  k3jax prepare-data corpus/ web.jsonl wiki.parquet --out data/mix_a --tokenizer MODEL_DIR

SRC: text files and folders (one document per file), JSONL files (one document per row, the
--text-field), parquet files (the --text-field column, read a row group at a time); local
paths or fsspec URLs (gs://... with gcsfs installed, file://, memory://). A folder is read
recursively in path order: *.jsonl(.gz|.zst) as JSONL, *.parquet as parquet, text suffixes
(.txt .md .rst .py .json .c .h .html) as text; hidden and other files are skipped.

Tokenized in --workers processes with MODEL_DIR's tokenizer (bytes without --tokenizer), the
tokenizer's end-of-document id appended to every document (bytes have none; the manifest says
so). Written as ArrayRecord shards of token arrays plus manifest.json (sources, documents and
tokens per shard, the tokenizer's fingerprint, the format version). Running the same command
again resumes an interrupted run, or does nothing if it finished. A bad row (not JSON, the
field missing or not a string, bytes that are not UTF-8) is skipped and listed in
OUT/rejected.jsonl; --strict refuses the run at the first one.
"""

from __future__ import annotations

import json
import os

from k3jax.commands._args import Formatter, nonneg_int, positive_int
from k3jax.corpus.prepare import PrepareOptions, prepare


def run(args) -> int:
  summary = prepare(PrepareOptions(
      sources=tuple(args.sources), out=args.out, tokenizer=args.tokenizer,
      text_field=args.text_field, workers=args.workers, shard_tokens=args.shard_tokens,
      strict=args.strict, progress=not args.no_progress))
  if summary["added_documents"] == 0 and summary["resumed_after_shards"] is not None:
    print(f"nothing to do: {summary['out']} is complete")
  else:
    rate = summary["tokens_per_s"] or 0.0
    print(f"{summary['out']}: {summary['documents']:,} documents, {summary['tokens']:,} tokens "
          f"in {summary['shards']} shard(s), {summary['rejected']:,} rejected row(s); this run "
          f"{summary['added_tokens']:,} tokens in {summary['seconds']:.1f}s "
          f"({rate:,.0f} tokens/s); end of document: {summary['end_of_document']}")
  if args.json:
    print(json.dumps(summary))
  return 0


def register(sub) -> None:
  p = sub.add_parser("prepare-data", help="tokenize text sources into a prepared dataset",
                     description=__doc__, formatter_class=Formatter)
  p.add_argument("sources", nargs="+", metavar="SRC",
                 help="text files / folders, JSONL or parquet files; paths or fsspec URLs")
  p.add_argument("--out", required=True, metavar="DIR",
                 help="the dataset folder (created; an unfinished one is resumed)")
  p.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                 help="a model folder whose tokenizer to use, or byte (none given: bytes)")
  p.add_argument("--text-field", default="text",
                 help="the JSONL field / parquet column holding each document's text")
  p.add_argument("--workers", type=nonneg_int, default=os.cpu_count() or 1,
                 help="tokenizing processes (0: tokenize in this process)")
  p.add_argument("--shard-tokens", type=positive_int, default=100_000_000, metavar="M",
                 help="a shard closes once it holds M tokens (whole documents)")
  p.add_argument("--strict", action="store_true",
                 help="refuse the run at the first bad row (default: skip and list it in "
                      "OUT/rejected.jsonl)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--json", action="store_true", help="also print the summary as JSON")
  p.set_defaults(func=run)
