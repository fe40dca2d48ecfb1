"""A full-remat scan over layer units that copies neither the AttnRes block buffer per layer
nor the parameter stacks.

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

Each layer also reads its parameters from the full stacks by index inside the loop, where a
scan over strided slices of the stacks would copy them first (see `scan`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from k3jax.model import saved_attention

# layer(carry, states, layer_index, segment_ids) -> (carry, outputs); carry is transformer.Carry
Layer = Callable


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _dense(ct) -> list:
  """The float leaves of a cotangent tree, symbolic zeros made arrays (integer leaves'
  float0 cotangents dropped)."""
  out = []
  for x in jax.tree.leaves(ct, is_leaf=lambda x: isinstance(x, SymbolicZero)):
    if isinstance(x, SymbolicZero):
      x = jnp.zeros(x.shape, x.dtype)
    if _is_float(x):
      out.append(x)
  return out


def _fill(like, floats: Sequence):
  """`like`'s tree with its float leaves replaced by `floats` (in order) and its other leaves
  by float0 zeros (the cotangent of an integer)."""
  it = iter(floats)
  leaves, tree = jax.tree.flatten(like)
  out = [next(it) if _is_float(x) else np.zeros(np.shape(x), jax.dtypes.float0) for x in leaves]
  return jax.tree.unflatten(tree, out)


class Position(NamedTuple):
  """One layer of the unit: its stacks (norms, mixer, MLP), their entries in the first repeat
  and the entry step from one repeat to the next (schedule.Run)."""
  kinds: tuple[str, ...]
  entries: tuple[int, ...]
  strides: tuple[int, ...]


def _entries(pos: Position, u):
  return [e + s * u for e, s in zip(pos.entries, pos.strides)]


def _index(a, e):
  return jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False)


def _select(stacks: dict, pos: Position, u) -> tuple:
  """The states of `pos` in repeat `u` (traced): one entry of each stack, read in place."""
  return tuple(jax.tree.map(lambda a, e=e: _index(a, e), stacks[k])
               for k, e in zip(pos.kinds, _entries(pos, u)))


def _unwrap(tree):
  is_primal = lambda x: isinstance(x, CustomVJPPrimal)
  return (jax.tree.map(lambda x: x.value, tree, is_leaf=is_primal),
          jax.tree.map(lambda x: x.perturbed, tree, is_leaf=is_primal))


def scan(layers: Sequence[Layer], positions: Sequence[Position], carry, stacks: dict,
         count: int, first_layer: int, segment_ids, *, save_attention: bool = False):
  """`lax.scan` of a unit (the `layers`, in order; layer q of repeat u is model layer
  `first_layer + len(layers) * u + q`) over `count` repeats, each layer reading its entries of
  the parameter `stacks` ({name: stacked state}) by index inside the loop. Returns (carry,
  [outputs of each position, stacked [count, ...]]). `layers` must not be rematerialised
  themselves (the backward already recomputes each one once).

  The stacks are loop constants, not sliced scan inputs: a strided slice of a stack is a copy
  of it before the loop, and its gradient another (stacked, then padded into the stack's
  shape). The backward adds each layer's parameter gradient into its entry of a
  stack-shaped accumulator carried by the reverse loop (updated in place), and only for the
  parameters being differentiated (LoRA's frozen base weights get neither accumulator nor
  weight-gradient matmuls).

  save_attention: the forward also keeps each layer's flash attention outputs (recorded on
  saved_attention's tape) and the recompute replays them instead of running the attention's
  forward loops again."""
  p = len(layers)
  units = jnp.arange(count, dtype=jnp.int32)
  names = sorted(stacks)
  trained = {}  # stack name -> per-leaf "float and differentiated", set when fwd is traced

  def unit(carry, stacks, u, segment_ids, keep: bool):
    outs, kept = [], []
    for q, layer in enumerate(layers):
      inp = (carry.partial, carry.n_sealed)
      record = keep and save_attention
      with saved_attention.recording() if record else contextlib.nullcontext() as attended:
        carry, out = layer(carry, _select(stacks, positions[q], u), first_layer + p * u + q,
                           segment_ids)
      if keep:
        kept.append((*inp, tuple(attended or ())))
      outs.append(out)
    return carry, (outs, kept)

  @jax.custom_vjp
  def run(carry, stacks, segment_ids):
    carry, (outs, _) = jax.lax.scan(lambda c, u: unit(c, stacks, u, segment_ids, False),
                                    carry, units)
    return carry, outs

  def fwd(carry, stacks, segment_ids):
    (carry, _), (stacks, perturbed), (segment_ids, _) = (
        _unwrap(carry), _unwrap(stacks), _unwrap(segment_ids))
    for k in names:
      trained[k] = [_is_float(x) and d for x, d in zip(jax.tree.leaves(stacks[k]),
                                                       jax.tree.leaves(perturbed[k]))]
    out_carry, (outs, kept) = jax.lax.scan(lambda c, u: unit(c, stacks, u, segment_ids, True),
                                           carry, units)
    return (out_carry, outs), (out_carry.blocks, kept, stacks, segment_ids)

  def bwd(res, ct):
    blocks, kept, stacks, segment_ids = res
    ct_carry, ct_outs = ct
    flat = {k: jax.tree.flatten(stacks[k]) for k in names}

    def back(ct_c, inp):
      kept_u, u, ct_outs_u = inp
      ct_blocks, ct_partial, acc = ct_c
      acc = dict(zip(names, acc))
      for q in reversed(range(p)):
        partial, n, attended = kept_u[q]
        # Layer q's recompute needs nothing from the backward after it, so the scheduler
        # may run every layer's recompute of the unit first and hold all their residuals at
        # once (K3: four MoE layers' dispatch buffers). Tying its input to the cotangent
        # that arrives from layer q + 1 keeps one layer's residuals alive at a time.
        partial, ct_partial = jax.lax.optimization_barrier((partial, ct_partial))
        pos = positions[q]
        sel = {k: [_index(a, e) for a in flat[k][0]] for k, e in zip(pos.kinds, _entries(pos, u))}

        def f(c, diff, q=q, pos=pos, sel=sel, attended=attended):
          states = []
          for k in pos.kinds:
            it = iter(diff[k])
            leaves = [next(it) if t else x for x, t in zip(sel[k], trained[k])]
            states.append(jax.tree.unflatten(flat[k][1], leaves))
          with saved_attention.replaying(attended) if save_attention else contextlib.nullcontext():
            return layers[q](c, tuple(states), first_layer + p * u + q, segment_ids)

        diff = {k: [x for x, t in zip(sel[k], trained[k]) if t] for k in pos.kinds}
        (_, out), vjp = jax.vjp(f, carry_like(blocks, n, partial), diff)
        ct_c_out = carry_like(ct_blocks, np.zeros((), jax.dtypes.float0), ct_partial)
        ct_c_in, ct_diff = vjp((ct_c_out, _fill(out, ct_outs_u[q])))
        ct_blocks, ct_partial = ct_c_in.blocks, ct_c_in.partial
        for k, e in zip(pos.kinds, _entries(pos, u)):
          acc[k] = [jax.lax.dynamic_update_index_in_dim(a, _index(a, e) + c.astype(a.dtype), e, 0)
                    for a, c in zip(acc[k], ct_diff[k])]
      return (ct_blocks, ct_partial, [acc[k] for k in names]), None

    acc0 = [[jnp.zeros_like(x) for x, t in zip(flat[k][0], trained[k]) if t] for k in names]
    ct0 = (*_dense((ct_carry.blocks, ct_carry.partial)), acc0)
    (ct_blocks, ct_partial, acc), _ = jax.lax.scan(
        back, ct0, (kept, units, [_dense(c) for c in ct_outs]), reverse=True)
    ct_stacks = {}
    for k, a in zip(names, acc):
      it = iter(a)
      ct_stacks[k] = jax.tree.unflatten(flat[k][1], [next(it) if t else None for t in trained[k]])
    return carry_like(ct_blocks, None, ct_partial), ct_stacks, None

  carry_like = type(carry)
  run.defvjp(fwd, bwd, symbolic_zeros=True)
  return run(carry, stacks, segment_ids)
