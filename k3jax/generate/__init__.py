"""Inference pieces below the serving engine (k3jax/engine/): `static_batch` (the static,
left-padded batch with a jitted decode loop: the baseline the engine's benchmark compares
against, and a second reference for its tests), `sampling` (greedy / temperature / top-k /
top-p / min-p, per row), `chat` (the folder's chat template). The cache and the model's cached
forward live in k3jax/model/cache.py and k3jax/model/decode.py."""
