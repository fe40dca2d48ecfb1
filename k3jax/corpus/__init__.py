"""Training corpora at scale: prepared datasets (token shards + manifest), mixtures of them,
and the per-data-shard streams the trainer reads (docs/training.md#data-at-scale).

    sources    text / JSONL / parquet files, local or fsspec URLs -> items
    encode     items -> token arrays with the end-of-document id (prepare-data's workers)
    prepare    `k3jax prepare-data`: ArrayRecord shards + manifest.json, resumable
    manifest   the manifest: format, fingerprint, checks against the shards
    shards     ArrayRecord shard writer / lazy random-access reader
    holdout    which documents are held out for eval
    prepared   a prepared dataset opened for reading: documents by index, train / held out
    mixture    `--data-mix mix.json`: components, weights, the deterministic interleave
    stream     one data shard's packed rows: groups of documents packed first-fit
"""
