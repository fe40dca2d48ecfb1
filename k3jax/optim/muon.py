"""Per-Head Muon (the K3 report §2.5; docs/training.md#per-head-muon) as an optax
`GradientTransformation`.

Muon orthogonalises the (Nesterov) momentum of each weight matrix with a quintic
Newton-Schulz iteration. K3 applies it per head: a per-head projection is not one matrix but
one matrix per head (KDA q/k/v: d -> 128 per head; MLA q_b: 1536 -> 192; MLA k_b / v_b:
512 -> 128), and each routed expert's matrix is orthogonalised on its own. Which axes are
batch axes and which form the matrix is read from the parameters' logical axis names
(k3jax/optim/groups.py); everything that is not a matrix goes to AdamW.

Per Muon block of shape fan_in x fan_out (Moonlight / K2 form):
    m   <- beta m + (1 - beta) g                   # optax's bias-corrected Nesterov momentum
    O   =  NewtonSchulz5(beta m_hat + (1 - beta) g_hat)   # in float32
    u   =  0.2 * sqrt(max(fan_in, fan_out)) * O    # RMS of O is ~1/sqrt(max): u has RMS ~0.2,
                                                   # AdamW's typical update RMS
    W   <- W - lr * (u + weight_decay * W)         # decoupled weight decay

Gradient clipping and accumulation compose from outside, e.g.
`optax.chain(optax.clip_by_global_norm(1.0), per_head_muon(...))` and `optax.MultiSteps`.

The transform must only ever see `nnx.Param` leaves: the router bias (`RouterBias`, set by
Quantile Balancing) is a different variable type, so `nnx.Optimizer(model, tx, wrt=nnx.Param)`
and `logical_axes_from_state(nnx.state(model, nnx.Param))` both exclude it, and
`logical_axes_from_state` refuses any non-Param leaf.

References:
  Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
    https://kellerjordan.github.io/posts/muon/ (quintic coefficients (3.4445, -4.7750, 2.0315)).
  Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982, 2025
    (0.2 * sqrt(max(A, B)) RMS matching, decoupled weight decay).
  Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, 2025 (MuonClip).
  Kimi Team, "Kimi K3" tech report, arXiv 2607.24653, 2026, §2.5 (Per-Head Muon).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from k3jax.optim.groups import (
  ADAM,
  MUON,
  LogicalAxes,
  block_shape,
  dimension_numbers,
  is_names,
  param_labels,
  resolve_logical_axes,
)
from k3jax.optim.ns_layout import moves, ns_placement
from sharding.rules import logical_to_spec

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(x: jax.Array, steps: int = 5, *, coeffs: tuple[float, float, float] = NS_COEFFS,
                  eps: float = 1e-7,
                  precision: jax.lax.Precision | None = jax.lax.Precision.HIGHEST) -> jax.Array:
  """Approximate orthogonalisation U V^T of each matrix in x [..., m, n] (batched over leading
  axes).

  Quintic iteration X <- a X + (b A + c A^2) X with A = X X^T, from X = G / (||G||_F + eps)
  (every singular value <= 1). The coefficients maximise the slope at zero rather than
  converge, so the result is U S' V^T with S' roughly in [0.7, 1.2], which is all Muon needs.
  Tall matrices are transposed so A is the smaller Gram matrix (NS(X^T) = NS(X)^T).
  Computed in float32 (float64 stays float64); `precision` HIGHEST keeps TPU matmuls in fp32.
  """
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs [..., m, n], got shape {x.shape}")
  a, b, c = coeffs
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = jnp.swapaxes(x, -1, -2)
  x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
  mm = lambda p, q: jnp.matmul(p, q, precision=precision)
  for _ in range(steps):
    gram_mm = mm(x, jnp.swapaxes(x, -1, -2))
    x = a * x + mm(b * gram_mm + c * mm(gram_mm, gram_mm), x)
  return jnp.swapaxes(x, -1, -2) if tall else x


def orthogonalize(x: jax.Array, dn: MuonDimensionNumbers, *, steps: int = 5,
                  coeffs: tuple[float, float, float] = NS_COEFFS, eps: float = 1e-7,
                  precision: jax.lax.Precision | None = jax.lax.Precision.HIGHEST) -> jax.Array:
  """Newton-Schulz on every block of x: batch axes (those not in `dn`) index the blocks, the
  reduction / output axes (flattened in order) are the block's rows / columns. float32 out.

  The batch axes are kept as separate leading axes (never merged into one), so a batch axis
  sharded on the mesh (heads on `tensor`, experts on `expert`) stays sharded and per-block work
  needs no communication."""
  red, out = tuple(dn.reduction_axis), tuple(dn.output_axis)
  batch = tuple(a for a in range(x.ndim) if a not in red + out)
  perm = batch + red + out
  _, fan_in, fan_out = block_shape(x.shape, dn)
  batch_shape = tuple(x.shape[a] for a in batch)
  x_t = _gather_block_dims(jnp.transpose(x, perm), len(batch))
  x_mn = x_t.reshape(batch_shape + (fan_in, fan_out))
  o_mn = newton_schulz(x_mn, steps, coeffs=coeffs, eps=eps, precision=precision)
  o = jnp.transpose(o_mn.reshape(x_t.shape), tuple(perm.index(a) for a in range(x.ndim)))
  return _like_sharding(o, x)


def _spec(x: jax.Array) -> tuple:
  """x's PartitionSpec in its type: only explicit-sharding mesh axes appear there (under
  Auto axes, plain jit, every entry is None and the helpers below do nothing)."""
  spec = tuple(getattr(jax.typeof(x).sharding, "spec", ()) or ())
  return spec + (None,) * (x.ndim - len(spec))


def _gather_block_dims(x: jax.Array, num_batch: int) -> jax.Array:
  """Explicit sharding: Newton-Schulz contracts over the block's own dims, for which a sharded
  contraction has no defined result sharding, so those dims are gathered first. The leading
  batch axes keep their placement: per-head and per-expert blocks stay on their devices."""
  spec = _spec(x)
  if all(s is None for s in spec[num_batch:]):
    return x
  return jax.sharding.reshard(x, jax.P(*spec[:num_batch], *([None] * (x.ndim - num_batch))))


def _like_sharding(o: jax.Array, x: jax.Array) -> jax.Array:
  return o if _spec(o) == _spec(x) else jax.sharding.reshard(o, jax.P(*_spec(x)))


class ScaleByPerHeadMuonState(NamedTuple):
  """count: int32 step counter; mu: momentum, one leaf per Muon matrix (mu_dtype or the
  parameter's dtype)."""
  count: jax.Array
  mu: optax.Updates


def _context_mesh():
  """The context mesh (`jax.set_mesh`) when it has Auto axes to place with, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes or not mesh.are_all_axes_auto:
    return None
  return mesh


def _newton_schulz_split(x_mn: jax.Array, axes, *, steps: int, coeffs, eps: float,
                         precision) -> jax.Array:
  """newton_schulz of one [m, n/k] block (m <= n) whose columns are split over `axes` (k
  ways), inside shard_map: the norm and each Gram matrix A = X X^T are psums over `axes`;
  the rest is local. Where this device's n/k columns are fewer than m, the update is
  a X + b (A X) + c A (A X), 6 m^2 n/k FLOPs, rather than a X + (b A + c A A) X, whose A A
  costs every device of the split 2 m^3. Equal to newton_schulz up to summation order."""
  a, b, c = coeffs
  psum = (lambda v: jax.lax.psum(v, axes)) if axes else (lambda v: v)
  x = x_mn.astype(jnp.promote_types(x_mn.dtype, jnp.float32))
  x = x / (jnp.sqrt(psum(jnp.sum(x * x))) + eps)
  mm = lambda p, q: jnp.matmul(p, q, precision=precision)
  for _ in range(steps):
    gram = psum(mm(x, x.T))
    if x.shape[1] < x.shape[0]:
      ax = mm(gram, x)
      x = a * x + b * ax + c * mm(gram, ax)
    else:
      x = a * x + mm(b * gram + c * mm(gram, gram), x)
  return x


def _orthogonalize_split(x: jax.Array, there, split: tuple[str, ...], mesh,
                         dn: MuonDimensionNumbers, **ns) -> jax.Array:
  """orthogonalize on x placed as `there` (ns_layout.NSPlacement): blocks as [batch..., m, n]
  (m <= n), the batch axes where `there` has them, each block's long side split over
  `split` (or whole: split = ()); each device runs its blocks one at a time (a loop, so
  Newton-Schulz holds one block's fp32 copies, not those of all its blocks: K3's experts on a
  1024-device pod hold [12, 7, 3072, 3584] a device, 3.4 GiB a copy), psum-ing each Gram
  matrix over `split`."""
  red, out = tuple(dn.reduction_axis), tuple(dn.output_axis)
  batch = tuple(a for a in range(x.ndim) if a not in red + out)
  perm = batch + red + out
  _, fan_in, fan_out = block_shape(x.shape, dn)
  tall = fan_in > fan_out
  x_t = jnp.transpose(x, perm)
  lead = x_t.shape[:len(batch)]
  x_mn = x_t.reshape(lead + (fan_in, fan_out))
  x_mn = jnp.swapaxes(x_mn, -1, -2) if tall else x_mn
  there = tuple(there) + (None,) * (x.ndim - len(there))
  spec = jax.P(*(there[a] for a in batch), None, split or None)

  def local(blocks):
    flat = blocks.reshape((-1,) + blocks.shape[-2:])
    o = jax.lax.map(functools.partial(_newton_schulz_split, axes=split, **ns), flat)
    return o.reshape(blocks.shape)

  o_mn = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(
      jax.lax.with_sharding_constraint(x_mn, spec))
  o_mn = jnp.swapaxes(o_mn, -1, -2) if tall else o_mn
  return jnp.transpose(o_mn.reshape(x_t.shape), tuple(perm.index(a) for a in range(x.ndim)))


def _orthogonalize_placed(m_hat: jax.Array, names, dn: MuonDimensionNumbers,
                          whole_blocks: bool, **ns) -> jax.Array:
  """orthogonalize on a context mesh, in the placement ns_layout.ns_placement picks (whole
  blocks per device, or blocks split along their long side) and back to the parameter's
  placement after."""
  mesh = _context_mesh() if whole_blocks else None
  if mesh is None:
    return orthogonalize(m_hat, dn, **ns)
  shape = m_hat.shape
  home = logical_to_spec(names, mesh=mesh, shape=shape)
  there, padded, split = ns_placement(home, shape, dn, dict(mesh.shape))
  if there == home and not split:
    return orthogonalize(m_hat, dn, **ns)
  if padded != shape:  # zero blocks (a local pad where that axis is whole at home: layers)
    m_hat = jax.lax.with_sharding_constraint(
        jnp.pad(m_hat, [(0, p - s) for p, s in zip(padded, shape)]), home)
  path = moves(home, there, m_hat.ndim)
  for spec in path:
    m_hat = jax.lax.with_sharding_constraint(m_hat, spec)
  o = _orthogonalize_split(m_hat, there, split, mesh, dn, **ns)
  for spec in reversed([home] + path):  # pinned where it was computed, then back
    o = jax.lax.with_sharding_constraint(o, spec)
  if padded != shape:
    o = jax.lax.with_sharding_constraint(o[tuple(slice(0, s) for s in shape)], home)
  return o


def scale_by_per_head_muon(logical_axes: LogicalAxes, *, beta: float = 0.95,
                           nesterov: bool = True, ns_steps: int = 5,
                           ns_coeffs: tuple[float, float, float] = NS_COEFFS, eps: float = 1e-7,
                           consistent_rms: float = 0.2, mu_dtype: Any = None,
                           precision: jax.lax.Precision | None = jax.lax.Precision.HIGHEST,
                           whole_blocks: bool = True) -> optax.GradientTransformation:
  """Momentum -> per-block Newton-Schulz -> `consistent_rms * sqrt(max(fan_in, fan_out))`.

  `whole_blocks`: traced under a context mesh (`jax.set_mesh`, Auto axes), orthogonalise in
  the placement of k3jax/optim/ns_layout.py (mesh axes moved off the block axes onto a batch
  axis, so every device holds whole blocks) instead of leaving split blocks to the
  partitioner. No effect without a mesh.

  Expects to see Muon matrices only (it is the "muon" branch of `per_head_muon`'s
  `optax.partition`; other leaves arrive as `optax.MaskedNode` and pass through). The momentum
  is exactly `optax.contrib.scale_by_muon`'s (bias-corrected Nesterov), so a 2-D parameter gets
  the same update as optax's Muon; the differences are the per-block layout from logical names,
  Newton-Schulz in float32 whatever the parameter dtype, and the Moonlight RMS scale.
  """
  def names_tree(tree):
    return resolve_logical_axes(logical_axes, tree)

  def init_fn(params):
    return ScaleByPerHeadMuonState(count=jnp.zeros([], jnp.int32),
                                   mu=optax.tree.zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                            optax.tree.bias_correction(updates, beta, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)

    def one(names, m_hat, g):
      dn = dimension_numbers(names)
      if dn is None:  # not a Muon matrix: masked out by the partition
        return g
      o = _orthogonalize_placed(m_hat, names, dn, whole_blocks, steps=ns_steps,
                                coeffs=ns_coeffs, eps=eps, precision=precision)
      _, fan_in, fan_out = block_shape(m_hat.shape, dn)
      # the momentum's dtype (promote(grad, mu_dtype)), as optax's AdamW does: with fp32
      # moments the update reaches optax.apply_updates in fp32 even for bf16 parameters
      return (consistent_rms * max(fan_in, fan_out) ** 0.5 * o).astype(m_hat.dtype)

    new_updates = jax.tree.map(one, names_tree(updates), mu_hat, updates, is_leaf=is_names)
    # the state keeps the dtype it was created with (mu_dtype or the parameter's), whatever
    # the gradient dtype, so it is a fixed point of jit / scan carries
    return new_updates, ScaleByPerHeadMuonState(count=count,
                                                 mu=optax.tree.cast_like(mu, state.mu))

  return optax.GradientTransformation(init_fn, update_fn)


def _matrix_decay_mask(axes: Any) -> Any:
  """Default AdamW decay mask: tables with a `vocab` axis (embedding, lm_head) decay; gains,
  A_log, dt_bias, conv taps and AttnRes queries do not (decaying a norm gain towards zero or a
  decay-rate parameter is not regularisation, it changes the function)."""
  return jax.tree.map(lambda n: "vocab" in n, axes, is_leaf=is_names)


def per_head_muon(learning_rate: optax.ScalarOrSchedule, *, logical_axes: LogicalAxes,
                  momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.1,
                  ns_steps: int = 5, ns_coeffs: tuple[float, float, float] = NS_COEFFS,
                  eps: float = 1e-7, consistent_rms: float = 0.2,
                  adam_b1: float = 0.9, adam_b2: float = 0.95, adam_eps: float = 1e-8,
                  adam_learning_rate: optax.ScalarOrSchedule | None = None,
                  adam_weight_decay: float | None = None, adam_weight_decay_mask: Any = None,
                  mu_dtype: Any = None,
                  ns_precision: jax.lax.Precision | None = jax.lax.Precision.HIGHEST,
                  whole_blocks: bool = True) -> optax.GradientTransformation:
  """Per-Head Muon for weight matrices, AdamW for everything else (the K3 recipe;
  docs/training.md#optimizer-groups).

  Args:
    learning_rate: Muon learning rate, a float or an optax schedule (e.g.
      `optax.warmup_cosine_decay_schedule`).
    logical_axes: logical axis names of every parameter, a pytree with the same structure as
      the params the optimizer is given (leaves: tuples of names), e.g.
      `logical_axes_from_state(nnx.state(model, nnx.Param))`; or a callable params -> such a
      tree; or the `nnx.State` of Params itself (only its names are kept).
    momentum: Muon's Nesterov momentum (0.95).
    nesterov: Nesterov (True) or heavy-ball momentum.
    weight_decay: decoupled weight decay of the Muon matrices (W -= lr * wd * W).
    ns_steps, ns_coeffs, eps: the Newton-Schulz iteration.
    consistent_rms: target update RMS; each block's orthogonalised update is multiplied by
      `consistent_rms * sqrt(max(fan_in, fan_out))`.
    adam_b1, adam_b2, adam_eps: AdamW for the non-matrix parameters.
    adam_learning_rate: AdamW's learning rate (float or schedule); defaults to learning_rate.
    adam_weight_decay: AdamW's decoupled decay; defaults to weight_decay.
    adam_weight_decay_mask: which AdamW parameters decay (tree of bools or callable); default:
      only the tables with a `vocab` axis (embedding, lm_head).
    mu_dtype: dtype of both first moments; None keeps each parameter's dtype (fp32 with fp32
      master weights, the recipe). AdamW's second moment follows optax (parameter dtype).
    ns_precision: matmul precision inside Newton-Schulz (HIGHEST: fp32 on TPU as well).
    whole_blocks: on a context mesh, orthogonalise whole blocks per device (see
      `scale_by_per_head_muon` and k3jax/optim/ns_layout.py).

  Returns:
    An `optax.GradientTransformation` whose state is an `optax.PartitionState` with groups
    "muon" (ScaleByPerHeadMuonState, ..., learning-rate count) and "adam" (optax.adamw).
  """
  if not callable(logical_axes):
    # resolve once: a State of Params is reduced to its names and never held by the optimizer
    logical_axes = resolve_logical_axes(logical_axes, None)
  axes_of = lambda tree: resolve_logical_axes(logical_axes, tree)
  labels = lambda tree: param_labels(axes_of(tree))
  if adam_weight_decay_mask is None:
    adam_weight_decay_mask = lambda tree: _matrix_decay_mask(axes_of(tree))
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  if adam_weight_decay is None:
    adam_weight_decay = weight_decay
  muon_chain = optax.chain(
      scale_by_per_head_muon(logical_axes, beta=momentum, nesterov=nesterov, ns_steps=ns_steps,
                             ns_coeffs=ns_coeffs, eps=eps, consistent_rms=consistent_rms,
                             mu_dtype=mu_dtype, precision=ns_precision,
                             whole_blocks=whole_blocks),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
  adam = optax.adamw(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=adam_eps,
                     weight_decay=adam_weight_decay, mask=adam_weight_decay_mask,
                     mu_dtype=mu_dtype)
  return optax.partition({MUON: muon_chain, ADAM: adam}, labels)
