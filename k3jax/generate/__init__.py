"""Inference (SPEC §7): `engine` (left-padded batches, chunked prefill, the jitted decode loop),
`sampling` (greedy / temperature / top-k / top-p), `chat` (the folder's chat template), `cli`
(`k3jax generate`). The cache and the model's cached forward live in k3jax/model/cache.py and
k3jax/model/decode.py."""

from k3jax.generate.cli import register  # noqa: F401  (the `k3jax generate` subcommand)
