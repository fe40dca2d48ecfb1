"""Prepared datasets and mixtures of them as a run's training data
(docs/training.md#data-at-scale; the streams themselves: k3jax/corpus/stream.py).

Every process opens the components' manifests (no shard is opened until one of its documents
is read) and builds the streams of the data shards its rows need; `--data-workers N` packs
them in N Grain worker processes. A data shard's saved position is {"group", "row"} plus the
components' stream offsets and how many documents of each (by fingerprint) it had drawn up to
the current group; a new stage (k3jax/train/stages.py) opens the shards at those counts
(`starts`) for the components it keeps, on the stream slots they had (`streams`).

Eval: the components' held-out documents (k3jax/corpus/holdout.py) in the mixture's
interleave, in order, until there are enough for the eval batches; the same on every process.
"""

from __future__ import annotations

import numpy as np

from k3jax.corpus import mixture as mixture_lib
from k3jax.corpus.prepared import PreparedDataset
from k3jax.corpus.stream import GroupSource, RowStream, StreamSpec, group_documents
from k3jax.errors import UserError
from k3jax.train.data import PipelineConfig, ShardOpener, eval_batches, rows_to_batch

MAX_INDEX = 2**32  # Grain's index shuffle permutes 32-bit positions


def open_components(mix: mixture_lib.Mixture, tokenizer) -> list[PreparedDataset]:
  """The mixture's datasets, each checked against the run's tokenizer."""
  components = [PreparedDataset(p) for p in mix.paths]
  for d in components:
    if d.tokenizer["fingerprint"] != tokenizer.fingerprint:
      raise UserError(
          f"{d.folder} was prepared with the {d.tokenizer['name']} tokenizer "
          f"({d.tokenizer['fingerprint']}), the run trains with the {tokenizer.name} tokenizer "
          f"({tokenizer.fingerprint}); prepare it with --tokenizer MODEL_DIR of the model "
          "trained (or pass that --tokenizer here)")
    if not 0 < d.train_documents < MAX_INDEX:
      raise UserError(f"{d.folder}: {d.train_documents} documents to train on (at most "
                      f"{MAX_INDEX - 1}; split a larger corpus into a mixture)")
  return components


def document_proportions(mix: mixture_lib.Mixture, components) -> tuple[int, ...]:
  """The interleave's integer proportions: the weights as document shares (token shares
  divided by each component's mean document length)."""
  weights = mix.weights
  if mix.shares == "tokens":
    weights = [w / d.mean_document_tokens for w, d in zip(weights, components)]
  return mixture_lib.proportions(weights)


class _Batches:
  """A data shard's rows as model batches [A, b/S, T], with its data position."""

  def __init__(self, rows: RowStream, spec: StreamSpec, fingerprints, micro_batches: int):
    self._rows, self._spec, self._fps, self._a = rows, spec, fingerprints, micro_batches

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    r = next(self._rows)
    return rows_to_batch(r["tokens"], r["segment_ids"], self._a)

  def get_state(self) -> dict:
    state = self._rows.get_state()
    drawn = mixture_lib.counts(state["group"] * self._spec.group_documents,
                               self._spec.proportions)
    return {**state, "offsets": list(self._spec.offsets),
            "consumed": {fp: o + n for fp, o, n in zip(self._fps, self._spec.offsets, drawn)}}

  def close(self) -> None:
    self._rows.close()


def prepared_shards(components, props: tuple[int, ...], cfg: PipelineConfig, *,
                    workers: int = 0, starts: dict | None = None,
                    streams: dict[str, int] | None = None) -> ShardOpener:
  """`starts` {data shard: {fingerprint: documents}}: where a stage starts each component's
  stream (absent: 0); `streams` {fingerprint: slot}: the seed slot of each (None: its index)."""
  g = group_documents(components, props, cfg.seq_len)
  fingerprints = [d.fingerprint for d in components]
  slots = tuple(streams[fp] for fp in fingerprints) if streams else ()

  def open_shard(shard: int, state: dict | None):
    start = (starts or {}).get(shard, {})
    offsets = tuple(int(start.get(fp, 0)) for fp in fingerprints) if state is None else \
        tuple(state.get("offsets", ()))
    if state is not None and ("group" not in state or len(offsets) != len(components)):
      raise UserError(f"the checkpoint's data position of data shard {shard} is not one of "
                      f"this {len(components)}-component prepared dataset")
    spec = StreamSpec(cfg.seq_len, cfg.seed, shard, cfg.num_shards, g, props, offsets, slots)
    source = GroupSource([d.fresh() for d in components], spec)  # read on this shard's thread
    rows = RowStream(source, cfg.shard_rows, state, workers=workers)
    return _Batches(rows, spec, fingerprints, cfg.micro_batches)
  return open_shard


def held_out_documents(components, props, max_tokens: int) -> list[np.ndarray]:
  """Held-out documents in the mixture's interleave until `max_tokens`; a component whose
  held-out documents run out leaves the interleave (which starts over among the others)."""
  now = [p if d.held_out else 0 for d, p in zip(components, props)]
  taken = [0] * len(components)
  out, tokens, k = [], 0, 0
  while tokens < max_tokens and any(now):
    c, _ = mixture_lib.pick(k, now)
    doc = components[c].read([components[c].held_out_index(taken[c])])[0]
    out.append(doc)
    tokens, taken[c], k = tokens + len(doc), taken[c] + 1, k + 1
    if taken[c] == components[c].held_out:
      now[c], k = 0, 0
  return out


def describe(mix: mixture_lib.Mixture, components, props) -> str:
  if mix.file is None:
    d = components[0]
    return (f"prepared {d.folder}: {d.documents:,} documents ({d.held_out:,} held out), "
            f"{d.tokens:,} tokens, end of document: {d.manifest['end_of_document']}")
  total = sum(props)
  parts = ", ".join(f"{d.folder} {p / total:.3f}" for d, p in zip(components, props))
  return (f"mixture {mix.file} ({len(components)} prepared datasets, document shares: "
          f"{parts}), {sum(d.tokens for d in components):,} tokens")


def load(mix: mixture_lib.Mixture, tokenizer, cfg: PipelineConfig, max_eval_batches: int, *,
         workers: int = 0):
  """(shard opener, eval batches, description, summary, identity, stage opener) of a prepared
  dataset or mixture; identity: what run.json records so that a resume refuses other data;
  stage opener: (starts, streams) -> the shard opener of a stage (prepared_shards)."""
  components = open_components(mix, tokenizer)
  props = document_proportions(mix, components)
  budget = 2 * max_eval_batches * cfg.batch_rows * (cfg.seq_len + 1)
  evals = eval_batches(held_out_documents(components, props, budget), cfg, max_eval_batches)
  summary = {"format": "prepared", "shares": mix.shares, "mix_hash": mix.content_hash,
             "components": [{"path": d.folder, "fingerprint": d.fingerprint, "weight": w,
                             "documents": d.documents, "tokens": d.tokens,
                             "held_out_documents": d.held_out}
                            for d, w in zip(components, mix.weights)]}
  identity = {"manifests": {d.folder: d.fingerprint for d in components},
              "mix_hash": mix.content_hash if mix.file else None}
  def open_stage(starts: dict, streams: dict | None) -> ShardOpener:
    return prepared_shards(components, props, cfg, workers=workers, starts=starts,
                           streams=streams)
  return (prepared_shards(components, props, cfg, workers=workers), evals,
          describe(mix, components, props), summary, identity, open_stage)
