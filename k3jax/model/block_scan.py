"""A scan over layer units whose backward does not keep the AttnRes block buffer per layer.

Differentiating `lax.scan` keeps every iteration's input carry for the backward. With Block
AttnRes that carry holds the sealed-block buffer [n_seals, B, T, d], so a plain scan writes a
copy of the whole buffer per unit ([count, n_seals, B, T, d]: at K3's 93 layers, 8 seals, about
9x what full remat otherwise keeps per layer). Yet the buffer never loses what it held: a layer
only writes the next free slot, and AttnRes masks the slots not sealed yet (weight exactly 0,
gradient exactly 0, whatever finite value they hold). So the buffer a layer saw is the final
buffer with the same `n_sealed`, bit for bit on every slot that matters.

`scan` runs the forward as a plain scan that keeps, per layer, only its input `partial` [B, T, d]
and `n_sealed` (what full remat keeps anyway), and the backward as a reverse scan that rebuilds
each layer's input carry from the final buffer, recomputes the layer (`jax.vjp`: full remat) and
carries the block buffer's gradient from layer to layer, accumulated in place. The gradients
are those of the plain scan; only the float summation order may differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# layer(carry, states, layer_index, segment_ids) -> (carry, outputs); carry is transformer.Carry
Layer = Callable


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _float_leaves(tree) -> list:
  return [x for x in jax.tree.leaves(tree) if _is_float(x)]


def _fill(like, floats: Sequence):
  """`like`'s tree with its float leaves replaced by `floats` (in order) and its other leaves
  by float0 zeros (the cotangent of an integer)."""
  it = iter(floats)
  leaves, tree = jax.tree.flatten(like)
  out = [next(it) if _is_float(x) else np.zeros(np.shape(x), jax.dtypes.float0) for x in leaves]
  return jax.tree.unflatten(tree, out)


def scan(layers: Sequence[Layer], carry, xs, segment_ids):
  """`lax.scan` of a unit (the `layers`, in order) over `xs` = (per-position states stacked
  [count, ...], first layer index [count]), returning (carry, [outputs of each position,
  stacked [count, ...]]). `layers` must not be rematerialised themselves (the backward
  already recomputes each one once)."""

  def unit(carry, x, segment_ids, keep: bool):
    states, first = x
    outs, kept = [], []
    for q, layer in enumerate(layers):
      if keep:
        kept.append((carry.partial, carry.n_sealed))
      carry, out = layer(carry, states[q], first + q, segment_ids)
      outs.append(out)
    return carry, (outs, kept)

  @jax.custom_vjp
  def run(carry, xs, segment_ids):
    carry, (outs, _) = jax.lax.scan(lambda c, x: unit(c, x, segment_ids, False), carry, xs)
    return carry, outs

  def fwd(carry, xs, segment_ids):
    out_carry, (outs, kept) = jax.lax.scan(lambda c, x: unit(c, x, segment_ids, True), carry, xs)
    return (out_carry, outs), (out_carry.blocks, kept, xs, segment_ids, carry.n_sealed)

  def bwd(res, ct):
    blocks, kept, xs, segment_ids, n0 = res
    ct_carry, ct_outs = ct
    states, first = xs

    def back(ct_c, inp):
      kept_u, states_u, first_u, ct_outs_u = inp
      ct_blocks, ct_partial = ct_c
      ct_states = [None] * len(layers)
      for q in reversed(range(len(layers))):
        partial, n = kept_u[q]
        c_in = carry_like(blocks, n, partial)

        def f(c, s, q=q):
          return layers[q](c, s, first_u + q, segment_ids)

        (c_out, out), vjp = jax.vjp(f, c_in, states_u[q])
        ct_c_out = carry_like(ct_blocks, np.zeros((), jax.dtypes.float0), ct_partial)
        ct_out = _fill(out, ct_outs_u[q])
        ct_c_in, ct_s = vjp((ct_c_out, ct_out))
        ct_blocks, ct_partial = ct_c_in.blocks, ct_c_in.partial
        ct_states[q] = _float_leaves(ct_s)
      return (ct_blocks, ct_partial), ct_states

    ct0 = (ct_carry.blocks, ct_carry.partial)
    (ct_blocks, ct_partial), ct_states = jax.lax.scan(
        back, ct0, (kept, states, first, [_float_leaves(c) for c in ct_outs]), reverse=True)
    ct_xs = (_fill(states, [c for q in ct_states for c in q]),
             np.zeros(first.shape, jax.dtypes.float0))
    ct_seg = None if segment_ids is None else np.zeros(segment_ids.shape, jax.dtypes.float0)
    ct_n = np.zeros(np.shape(n0), jax.dtypes.float0)
    return carry_like(ct_blocks, ct_n, ct_partial), ct_xs, ct_seg

  carry_like = type(carry)
  run.defvjp(fwd, bwd)
  return run(carry, xs, segment_ids)
