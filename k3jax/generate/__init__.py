"""Inference: `engine` (left-padded batches, chunked prefill, the jitted decode loop),
`sampling` (greedy / temperature / top-k / top-p), `chat` (the folder's chat template). The
command is k3jax/commands/generate.py; the cache and the model's cached forward live in
k3jax/model/cache.py and k3jax/model/decode.py."""
