"""What a run trains and evaluates on (docs/training.md#data):

    --data DIR with manifest.json    a prepared dataset (`k3jax prepare-data`; prepared_data.py)
    --data-mix mix.json              a mixture of prepared datasets
    --data FILE | DIR (text)         documents read whole and tokenized at start-up (data.py)
    no --data                        this interpreter's standard-library sources
    --format chat --data FILE.jsonl  conversations (chat_data.py)

Data format version (`run.json` records it): 1, text documents without an end-of-document
id; 2 (from this version on), the tokenizer's end-of-document id after every text document
when it has one (a BPE folder; bytes have none). A resumed run keeps the version it started
with, so it continues on exactly the batches it would have had.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from k3jax.corpus import manifest as manifest_lib
from k3jax.corpus import mixture as mixture_lib
from k3jax.errors import UserError
from k3jax.train import chat_data, prepared_data
from k3jax.train.data import (
  PipelineConfig,
  ShardIterator,
  ShardOpener,
  eval_batches,
  folder_documents,
  in_memory_shards,
  split_documents,
  stdlib_documents,
  tokenize,
)

DATA_VERSION = 2
FIRST_DATA_VERSION = 1  # what a run file without a "data" entry was trained with


@dataclasses.dataclass(frozen=True)
class TrainingData:
  """What a run trains and evaluates on."""
  open_shard: ShardOpener                  # data shard, saved position -> its batches
  eval_batches: list[dict[str, np.ndarray]]
  description: str                         # for the start-up line
  summary: dict                            # for the run's summary
  identity: dict                           # for run.json: a resume refuses other data
  # the training documents held in memory (text, chat; None: prepared data), which a new
  # stage's pipelines (stages.py) re-open at an offset into their streams
  train_tokens: list[np.ndarray] | None = None
  train_weights: list[np.ndarray] | None = None
  # prepared data: (starts, streams) -> the shard opener of a stage (prepared_data.load)
  open_stage: Callable[[dict, dict | None], ShardOpener] | None = None

  def iterator(self, cfg: PipelineConfig, rows: tuple[int, int] | None = None,
               state: dict | None = None, offsets: dict[int, Any] | None = None,
               streams: dict[str, int] | None = None) -> ShardIterator:
    """`offsets`: a stage's start into its streams, {data shard: pieces} of in-memory
    documents or {data shard: {fingerprint: documents}} of prepared components; `streams`
    {fingerprint: slot}: a stage's prepared components' stream slots (stages.py)."""
    opener = self.open_shard
    if self.open_stage is not None and (offsets or streams):
      opener = self.open_stage(offsets or {}, streams)
    elif offsets:
      opener = in_memory_shards(self.train_tokens, cfg, self.train_weights, offsets)
    return ShardIterator(opener, cfg, rows, state)


def data_mixture(path: str | None, mix_file: str | None,
                 data_format: str) -> mixture_lib.Mixture | None:
  """The prepared data a run names (`--data-mix FILE`, or `--data DIR` holding a manifest),
  its manifests read and checked; None: text or chat data."""
  if mix_file is not None and path is not None:
    raise UserError("--data and --data-mix are exclusive")
  if mix_file is None and not (path and os.path.isdir(path) and manifest_lib.is_prepared(path)):
    return None
  if data_format != "text":
    raise UserError(f"--format {data_format} reads JSONL conversations; a prepared dataset "
                    "holds text documents")
  return mixture_lib.read(mix_file) if mix_file else mixture_lib.single(path)


@dataclasses.dataclass(frozen=True)
class DataChoice:
  """The data a run names, resolved before anything is written: the prepared mixture (None:
  text or chat), the data format version, and the identity run.json records."""
  mix: mixture_lib.Mixture | None
  version: int
  identity: dict
  changed: bool = False  # the prepared data differs from the run's (a new stage's)


def choose_data(path: str | None, mix_file: str | None, data_format: str,
                run_file: str, new_stage: bool = False) -> DataChoice:
  """The run's data, checked: manifests and the mixture file read (one line for any fault),
  and, when `run_file` exists (a resume), the same data it records: the same manifest
  fingerprints and mixture content hash (a dataset prepared again or an edited mixture is
  refused unless `new_stage`), and the data format version it trained with."""
  mix = data_mixture(path, mix_file, data_format)
  saved, saved_mix = {}, None
  if os.path.exists(run_file):
    with open(run_file) as f:
      recorded = json.load(f)
    saved, saved_mix = recorded.get("data") or {}, recorded.get("options", {}).get("data_mix")
  version = saved.get("data_version", FIRST_DATA_VERSION) if os.path.exists(run_file) \
      else DATA_VERSION
  identity = {"data_version": version}
  if mix is not None:
    identity["manifests"] = {p: manifest_lib.read_complete(p)["fingerprint"] for p in mix.paths}
    identity["mix_hash"] = mix.content_hash if mix.file else None
  changed = bool(saved) and (saved.get("manifests"), saved.get("mix_hash")) != (
      identity.get("manifests"), identity.get("mix_hash"))
  if not new_stage:  # another --data-mix file: check_stage names it
    _check_same_data(os.path.dirname(run_file), saved, identity,
                     saved_mix == (mix.file if mix else None))
  return DataChoice(mix, version, identity, changed)


def _check_same_data(out: str, saved: dict, now: dict, same_mix_file: bool) -> None:
  if not saved:
    return
  for folder, fp in (saved.get("manifests") or {}).items():
    if (now.get("manifests") or {}).get(folder, fp) != fp:
      raise UserError(f"{out} holds a run on {folder} as prepared then (manifest fingerprint "
                      f"{fp}); it now has {now['manifests'][folder]} (prepared again?): "
                      "resuming needs the same data: start a new stage with --new-stage, or "
                      "use a new --out")
  if same_mix_file and saved.get("mix_hash") != now.get("mix_hash"):
    raise UserError(f"{out} holds a run of a mixture with content hash {saved.get('mix_hash')}"
                    f", now {now.get('mix_hash')} (the mixture file was edited): resuming "
                    "needs the same mixture: start a new stage with --new-stage, or use a "
                    "new --out")


def load_training_data(path: str | None, data_format: str, tokenizer, cfg: PipelineConfig,
                       max_eval_batches: int, *, skip_bad_rows: bool = False,
                       out: str | None = ".", mix: mixture_lib.Mixture | None = None,
                       data_version: int = DATA_VERSION, workers: int = 0) -> TrainingData:
  """`mix`: prepared data (data_mixture); else `--format text`: documents (a file, a folder,
  or the stdlib sources when `path` is None); `--format chat`: JSONL conversations. `out`: the
  folder for chat's bad-rows list (None: not written, e.g. on processes other than 0);
  `workers`: Grain worker processes packing prepared data."""
  if mix is not None:
    *loaded, open_stage = prepared_data.load(mix, tokenizer, cfg, max_eval_batches,
                                             workers=workers)
    return TrainingData(*loaded, open_stage=open_stage)
  identity = {"data_version": data_version}
  if data_format == "text":
    return _text(path, tokenizer, cfg, max_eval_batches, data_version, identity)
  if data_format != "chat":
    raise UserError(f"--format {data_format}: expected text or chat")
  if path is None:
    raise UserError("--format chat needs --data FILE.jsonl (rows of {\"messages\": [...]})")
  corpus = chat_data.read_chat(path, tokenizer, cfg.seq_len)
  report = chat_data.check_bad_rows(corpus, path, skip=skip_bad_rows, out=out)
  (train_t, train_w), (eval_t, eval_w), held_out = corpus.split()
  n_train, n_trained = sum(map(len, train_t)), int(sum(w.sum() for w in train_w))
  return TrainingData(
      in_memory_shards(train_t, cfg, train_w),
      eval_batches(eval_t, cfg, max_eval_batches, eval_w),
      f"{len(train_t)} train + {len(eval_t) if held_out else 0} eval conversations"
      f"{'' if held_out else ' (eval on the train rows: too few to hold any out)'}, "
      f"{n_train:,} train tokens of which {n_trained:,} assistant tokens are trained",
      {"format": "chat", "rows": len(corpus.tokens), "bad_rows": len(corpus.bad),
       "bad_rows_file": report, "special_text_rows": len(corpus.special_text),
       "train_rows": len(train_t), "eval_rows": len(eval_t) if held_out else 0,
       "train_tokens": n_train, "trained_tokens": n_trained}, identity, train_t, train_w)


def _text(path, tokenizer, cfg, max_eval_batches, data_version, identity) -> TrainingData:
  docs = stdlib_documents() if path is None else folder_documents(path)
  eos = tokenizer.eos_id if data_version >= 2 else None
  train_docs, eval_docs = split_documents(docs)
  train_tokens = tokenize(train_docs, tokenizer, eos)
  eval_tokens = tokenize(eval_docs, tokenizer, eos)
  n_train = sum(map(len, train_tokens))
  end = "none" if eos is None else f"id {eos}"
  return TrainingData(
      in_memory_shards(train_tokens, cfg), eval_batches(eval_tokens, cfg, max_eval_batches),
      f"{len(train_docs)} train + {len(eval_docs)} eval documents, {n_train:,} train tokens, "
      f"end of document: {end}",
      {"format": "text", "documents": len(docs), "train_tokens": n_train,
       "end_of_document_id": eos}, identity, train_tokens)
