"""QK-clip (the "Clip" of MuonClip, Kimi K2 §2.1) for the MLA layers.

Muon's updates can grow attention logits without bound. After each optimizer step, for every
MLA head whose largest pre-softmax logit S_max (observed in this step's forward, after the
1/sqrt(192) scale) exceeds tau, rescale that head's query and key weights so the logit scales
by gamma = tau / S_max:

    q_nope (q_b_proj / q_proj [..., :nope]) and k_nope (k_b_proj)  *= sqrt(gamma)
    q_rope (q_b_proj / q_proj [..., nope:])                        *= gamma
    k_rope (the 64 shared dims of kv_a_proj)                       untouched (shared by heads)

The logit is q_nope.k_nope + q_rope.k_rope, both bilinear in these weights (their inputs are
RMS-normalised latents, independent of the weights), so the new logit is exactly gamma times the
old on the same input. Heads under the threshold are left alone (gamma = 1).

Selection is by logical names: in an MLA module the query weight is the parameter with a
`qk_head_dim` axis, the per-head key weight the one with a `qk_nope_dim` axis; their head axes
(`q_heads` / `kv_heads`) and an optional leading `layers` axis index `max_logits`.

Feeding it from the train step: the MLA forward computes, per head, the max over batch, query
and (unmasked) key positions of the pre-softmax logits, under `jax.lax.stop_gradient`, and
returns it (or sows it as an `nnx.Intermediate`); the layer scan stacks it into [layers, heads].
Under data parallelism a `jnp.max` over the sharded batch in the jitted step already is the
global max. After `optimizer.update(model, grads)`:

    params = nnx.state(model, nnx.Param)
    nnx.update(model, qk_clip(params, {("layers", "mla", "attn"): max_logits_lh}))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.optim.groups import is_names, logical_axes_from_state

QUERY_AXIS, KEY_AXIS = "qk_head_dim", "qk_nope_dim"
HEAD_AXES = ("q_heads", "kv_heads", "heads")


def qk_clip_factors(max_logits: jax.Array, threshold: float = 100.0) -> jax.Array:
  """gamma = min(1, tau / S_max) per head (1 where the head is under the threshold)."""
  max_logits = jnp.asarray(max_logits, jnp.float32)
  return jnp.where(max_logits > threshold, threshold / jnp.maximum(max_logits, threshold), 1.0)


def _key_tuple(path) -> tuple:
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(getattr(k, attr))
        break
  return tuple(out)


def _scale_for(names: tuple, shape: tuple, gamma: jax.Array, per_dim: jax.Array | None,
               where: str) -> jax.Array:
  """Broadcast gamma [layers?, heads] (and an optional per-head-dim exponent) to `shape`."""
  head = [i for i, n in enumerate(names) if n in HEAD_AXES]
  layer = [i for i, n in enumerate(names) if n == "layers"]
  if len(head) != 1:
    raise ValueError(f"{where}: expected one head axis in {names}")
  keep = layer + head
  want = tuple(shape[i] for i in keep)
  if gamma.shape != want:
    raise ValueError(f"{where}: max_logits has shape {gamma.shape}, expected {want} "
                     f"(axes {[names[i] for i in keep]})")
  g = gamma.reshape([shape[i] if i in keep else 1 for i in range(len(shape))])
  if per_dim is None:
    return jnp.sqrt(g)
  last = names.index(QUERY_AXIS)
  exponent = per_dim.reshape([shape[i] if i == last else 1 for i in range(len(shape))])
  return g ** exponent


def qk_clip(params: Any, max_logits: jax.Array | Mapping[tuple, jax.Array], *,
            logical_axes: Any = None, threshold: float = 100.0) -> Any:
  """Apply QK-clip to the MLA query/key weights in `params`; returns the same tree.

  Args:
    params: pytree of parameters, arrays or `nnx.Param`s (e.g. `nnx.state(model, nnx.Param)`).
    max_logits: per-head max pre-softmax logit [layers, heads] (or [heads] for an unstacked
      module). An array when `params` holds exactly one MLA module (one `qk_head_dim` and one
      `qk_nope_dim` parameter); otherwise a mapping from a module's path prefix (tuple of keys,
      as in `nnx.State`) to its array.
    logical_axes: names tree of `params`; default: read from the `nnx.Param` metadata.
    threshold: tau (K2: 100).
  """
  if logical_axes is None:
    logical_axes = logical_axes_from_state(params)
  is_var = lambda x: isinstance(x, nnx.Variable)
  flat_p, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)
  flat_n = jax.tree.leaves(logical_axes, is_leaf=is_names)
  if len(flat_n) != len(flat_p):
    raise ValueError("logical_axes does not match params")
  paths = [_key_tuple(p) for p, _ in flat_p]
  if not isinstance(max_logits, Mapping):
    max_logits = {(): max_logits}

  out = [leaf for _, leaf in flat_p]
  for prefix, logits in max_logits.items():
    prefix = tuple(prefix)
    inside = [i for i, p in enumerate(paths) if p[:len(prefix)] == prefix]
    queries = [i for i in inside if QUERY_AXIS in flat_n[i]]
    keys = [i for i in inside if KEY_AXIS in flat_n[i]]
    if len(queries) != 1 or len(keys) != 1:
      raise ValueError(f"under {prefix}: expected one {QUERY_AXIS} (MLA query) and one "
                       f"{KEY_AXIS} (MLA key) parameter, found {len(queries)} and {len(keys)}; "
                       "pass a mapping {module path: max_logits} to select one MLA module")
    gamma = qk_clip_factors(logits, threshold)
    (qi,), (ki,) = queries, keys
    value = lambda leaf: leaf.get_value() if is_var(leaf) else leaf
    q, k = value(out[qi]), value(out[ki])
    nope = k.shape[flat_n[ki].index(KEY_AXIS)]
    qk_dim = q.shape[flat_n[qi].index(QUERY_AXIS)]
    # exponent 1/2 on the nope dims, 1 on the rope dims of the query
    exponent = jnp.where(jnp.arange(qk_dim) < nope, 0.5, 1.0)
    for i, w, per_dim in ((qi, q, exponent), (ki, k, None)):
      scale = _scale_for(flat_n[i], w.shape, gamma, per_dim, str(paths[i]))
      new = (w.astype(jnp.promote_types(w.dtype, jnp.float32)) * scale).astype(w.dtype)
      out[i] = out[i].copy(new) if is_var(out[i]) else new
  return jax.tree_util.tree_unflatten(treedef, out)
