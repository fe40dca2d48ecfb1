"""The decode cache (docs/inference.md#the-cache): what a request keeps between tokens, stacked per
layer kind.

    kda    KDAState, each field stacked on a leading `layers` axis like the KDA parameters:
             conv_q, conv_k, conv_v  [n_kda, B, taps-1, H, K]  compute dtype (the conv tails)
             recurrent               [n_kda, B, H, K, V]       fp32 (fp64 in a float64 model)
    mla    MLACache, stacked like the MLA parameters:
             c      [n_mla, B, S, kv_lora]  normalised kv_a latent, compute dtype
             k_rot  [n_mla, B, S, rope]     the shared "rope" key (never rotated), compute dtype
    start  [B] int32  the first real position of each row (prompts are left-padded)
    length []  int32  positions written so far (the same for every row)

The same cache can be held per layer (`unstack`: kda a tuple of KDAState [B, ...], mla a tuple
of MLACache [B, S, ...]) for the unrolled decode of k3jax/model/decode.py; `stack` undoes it.

Nothing of AttnRes is cached: it mixes over depth per token, so a new token needs only its own
block sums. Bytes per request: the KDA part is fixed (K3: 69 x 96 x 128 x 128 x 4 = 414 MiB),
the MLA part grows by n_mla x (kv_lora + rope) x itemsize per token (K3 bf16: 27,648 B), the
figures `k3jax info` prints. S (`max_len`) is fixed when the cache is made, so every decode
step has one shape and compiles once.

Why left padding: every row's next token then sits at the same position, so one
`dynamic_update_slice` writes the new latents of the whole batch and one scalar `length`
describes the cache. A pad token is masked out of MLA (as a key) and zeroed before KDA's conv
(see kda.py), so a row computes exactly what it computes alone; there is no positional
encoding anywhere, so the shift itself changes nothing.

Under a mesh (callers trace under `jax.set_mesh`), `constrain` places the cache by the logical
names below through sharding/rules.py: batch over the data axes, KDA heads on `tensor`; the
MLA latent has no head axis (it is shared by every head), so it is replicated over `tensor`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.kda import KDAState
from k3jax.model.kda import initial_state as kda_initial_state
from sharding.activations import activation_spec


class MLACache(NamedTuple):
  c: jax.Array      # [n_mla, B, S, kv_lora]
  k_rot: jax.Array  # [n_mla, B, S, rope]


class Cache(NamedTuple):
  kda: KDAState | None
  mla: MLACache | None
  start: jax.Array   # [B] int32
  length: jax.Array  # [] int32


_CONV = ("layers", "batch", None, "heads", "head_dim")
LOGICAL_AXES = Cache(
    kda=KDAState(_CONV, _CONV, _CONV, ("layers", "batch", "heads", "head_dim", None)),
    mla=MLACache(("layers", "batch", "length", "kv_lora"), ("layers", "batch", "length", None)),
    start=("batch",), length=())


def init_cache(cfg: ModelConfig, ex: Execution, batch: int, max_len: int,
               start: jax.Array | np.ndarray | None = None) -> Cache:
  """An empty cache for `batch` rows of up to `max_len` positions, in `ex`'s compute dtype.
  `start` [B]: the number of left-pad positions of each row (default 0)."""
  n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
  kda = None
  if n_kda:
    one = kda_initial_state(cfg, ex, batch)
    kda = KDAState(*(jnp.zeros((n_kda, *a.shape), a.dtype) for a in one))
  mla = None
  if n_mla:
    shape = (n_mla, batch, max_len)
    mla = MLACache(jnp.zeros((*shape, cfg.kv_lora_rank), ex.jnp_dtype),
                   jnp.zeros((*shape, cfg.qk_rope_head_dim), ex.jnp_dtype))
  start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
  if start.shape != (batch,):
    raise ValueError(f"start has shape {start.shape}, expected ({batch},)")
  return Cache(kda, mla, start, jnp.zeros((), jnp.int32))


def is_stacked(cache: Cache) -> bool:
  return isinstance(cache.kda, KDAState) or isinstance(cache.mla, MLACache)


def unstack(cache: Cache) -> Cache:
  """Per-layer layout: a tuple of one KDAState / MLACache per layer."""
  kda = mla = None
  if cache.kda is not None:
    kda = tuple(KDAState(*(a[i] for a in cache.kda)) for i in range(cache.kda.recurrent.shape[0]))
  if cache.mla is not None:
    mla = tuple(MLACache(*(a[i] for a in cache.mla)) for i in range(cache.mla.c.shape[0]))
  return cache._replace(kda=kda, mla=mla)


def stack(cache: Cache) -> Cache:
  """Stacked layout (the inverse of `unstack`)."""
  if is_stacked(cache):
    return cache
  kda = None if cache.kda is None else KDAState(*(jnp.stack(f) for f in zip(*cache.kda)))
  mla = None if cache.mla is None else MLACache(*(jnp.stack(f) for f in zip(*cache.mla)))
  return cache._replace(kda=kda, mla=mla)


def bytes_per_request(cache: Cache) -> dict[str, int]:
  """Per row: the KDA recurrent state, the KDA conv tails, and the MLA cache per position."""
  cache = stack(cache)
  batch = cache.start.shape[0]
  out = {"kda_state": 0, "kda_conv": 0, "mla_per_token": 0}
  if cache.kda is not None:
    out["kda_state"] = cache.kda.recurrent.nbytes // batch
    out["kda_conv"] = sum(a.nbytes for a in cache.kda[:3]) // batch
  if cache.mla is not None:
    positions = cache.mla.c.shape[2]
    out["mla_per_token"] = sum(a.nbytes for a in cache.mla) // (batch * positions)
  return out


def specs(cache: Cache, mesh) -> Cache:
  """The cache's PartitionSpecs on `mesh` from the logical names (the activation column of
  the rules table), as a Cache of specs. A dimension the named mesh axes do not divide (e.g. 3
  prompts over data=2) is split over the longest prefix of them that does."""
  stacked = is_stacked(cache)

  def layer(entry, names):  # one layer's entry lacks the leading "layers" axis
    return type(entry)(*(activation_spec(n if stacked else n[1:], a.shape, mesh)
                         for a, n in zip(entry, names)))

  kda, mla = cache.kda, cache.mla
  if kda is not None:
    kda = layer(kda, LOGICAL_AXES.kda) if stacked else tuple(
        layer(e, LOGICAL_AXES.kda) for e in kda)
  if mla is not None:
    mla = layer(mla, LOGICAL_AXES.mla) if stacked else tuple(
        layer(e, LOGICAL_AXES.mla) for e in mla)
  return Cache(kda, mla, activation_spec(LOGICAL_AXES.start, cache.start.shape, mesh),
               jax.sharding.PartitionSpec())


def constrain(cache: Cache) -> Cache:
  """`cache` pinned to its `specs` when a mesh is set; unchanged otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return cache
  explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

  def place(x, spec):
    if explicit:  # sharding is part of the type there: move, do not assert
      return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)

  return jax.tree.map(place, cache, specs(cache, mesh),
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
