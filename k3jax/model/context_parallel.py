"""Context parallelism: one sequence's positions split over the `context` mesh axis
(docs/sharding.md#context-parallelism).

The rules table puts activations' `length` on `context`, so every per-token layer (projections,
norms, AttnRes, the MoE, the head) runs on a device's own positions with no communication.
Only the token mixers see across positions; they run inside a `shard_map` whose bodies call the
functions here on the local range, the context axis manual:

- KDA (k3jax/model/kda_parallel.py): each device runs its range from a zero state and gets the
  range's affine map of the state, S_out = M S_in + C (`pallas_kernels.kda.ops.kda_range`);
  `entering_states` composes the maps over the context axis, so every device learns the state
  its range really starts from, and the outputs are completed with it. The short convolutions
  read the previous device's last taps-1 inputs (`from_previous`).
- MLA (k3jax/model/mla_parallel.py): the compressed latent is all-gathered and each device
  attends its queries over the whole sequence.

`check` refuses, before anything compiles, what cannot be split.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from k3jax.errors import ConfigError
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda.reference import CHUNK
from pallas_kernels.vma import vary_like
from sharding.rules import CONTEXT_AXIS

AXIS = CONTEXT_AXIS


class Composition(enum.StrEnum):
  """How the devices' affine maps are composed over the context axis (`entering_states`)."""
  SEQUENTIAL = "sequential"  # n - 1 rounds: device i applies its map, passes S to i + 1
  TREE = "tree"              # log2(n) rounds of map composition (Hillis-Steele), then one apply


# up to this many devices the sequential rounds, beyond it the tree (`composition_for`)
SEQUENTIAL_UP_TO = 8


def composition_for(n: int) -> Composition:
  """The composition for a context axis of n devices: sequential up to 8 (as fast or faster
  measured on 8 CPU devices: a round applies a [K, K] map to a [K, V] state, where the tree
  composes [K, K] x [K, K + V]), the tree beyond (log2 n rounds of transfers where the
  sequential rounds' n - 1 transfers, each waiting on the one before, become the latency of a
  layer: 127 per KDA layer at context=128). docs/sharding.md#composing-the-maps."""
  return Composition.SEQUENTIAL if n <= SEQUENTIAL_UP_TO else Composition.TREE


def size(mesh) -> int:
  """The context axis's size on `mesh` (1 without a mesh or without the axis)."""
  if mesh is None:
    return 1
  return dict(mesh.shape).get(AXIS, 1)


def check(mesh, length: int, kda_backend: str | None = None) -> None:
  """ConfigError (one line) when `mesh` splits `length` positions over a context axis that
  cannot: the context size must divide them into whole KDA chunks per device, and the KDA
  backend must run a range's transition."""
  n = size(mesh)
  if n == 1:
    return
  if length % (n * CHUNK):
    raise ConfigError(f"context={n} does not split a sequence of {length} positions into whole "
                      f"KDA chunks of {CHUNK} per device (the length must be a multiple of "
                      f"{n * CHUNK})")
  if not kda_ops.has_transition(kda_backend):
    raise ConfigError(f"context={n} needs a KDA backend that runs a range's transition "
                      f"({', '.join(kda_ops.TRANSITION_BACKENDS)}); "
                      f"{kda_backend or kda_ops.default_backend()!r} does not")


def _shift(x, n: int, by: int):
  """x of device i - by on device i (zeros on devices i < by)."""
  return jax.lax.ppermute(x, AXIS, [(j, j + by) for j in range(n - by)])


def from_previous(x, first):
  """Device i gets device i - 1's `x`; device 0 gets `first` (same shape)."""
  n = jax.lax.axis_size(AXIS)
  return jnp.where(jax.lax.axis_index(AXIS) == 0, first, _shift(x, n, 1))


def from_last(x):
  """The last device's `x` on every device (a sum in which the others add exact zeros)."""
  last = jax.lax.axis_index(AXIS) == jax.lax.axis_size(AXIS) - 1
  return jax.lax.psum(jnp.where(last, x, jnp.zeros_like(x)), AXIS)


def _apply(m, s, precision):
  """M S per head: m [..., K, K], s [..., K, X]."""
  return jnp.einsum("...ij,...jx->...ix", m, s, precision=precision)


def entering_states(m, c, s0, *, composition: Composition | None = None,
                    precision=jax.lax.Precision.HIGHEST):
  """The state each device's range starts from: device i gets F_{i-1}(... F_0(s0)), where
  F_j(S) = m_j S + c_j is device j's map (m [..., K, K], c [..., K, V]) and s0 [..., K, V] the
  state entering the sequence (the same on every device).

  SEQUENTIAL: n - 1 rounds, in each of which every device applies its map to the state it holds
  and passes the result to the next (after round r devices 0..r + 1 hold their true state):
  n - 1 transfers of one state, a [K, K] x [K, V] product each.
  TREE: the maps compose associatively, (m2, c2) o (m1, c1) = (m2 m1, m2 c1 + c2), so
  ceil(log2 n) rounds of the Hillis-Steele scan give each device the composition of every map
  up to its own; one more transfer shifts it to the next device, which applies it to s0:
  log2(n) + 1 transfers of a map ([K, K + V]), a [K, K] x [K, K + V] product each.
  None: `composition_for(n)`."""
  n = jax.lax.axis_size(AXIS)
  i = jax.lax.axis_index(AXIS)
  composition = composition_for(n) if composition is None else Composition(composition)
  s0 = vary_like(s0, m, c)  # a loop carry keeps one type: as varying as the maps
  if composition == Composition.SEQUENTIAL:
    def round_(_, s):
      return jnp.where(i == 0, s0, _shift(_apply(m, s, precision) + c, n, 1))
    return jax.lax.fori_loop(0, n - 1, round_, s0)
  if composition != Composition.TREE:
    raise ValueError(f"unknown composition {composition!r}")
  mc = jnp.concatenate([m, c], axis=-1)  # [..., K, K + V]: the map as one operand
  k = m.shape[-1]
  step = 1
  while step < n:
    left = _shift(mc, n, step)
    mc = jnp.where(i >= step, jnp.concatenate(
        [_apply(mc[..., :k], left[..., :k], precision),
         _apply(mc[..., :k], left[..., k:], precision) + mc[..., k:]], axis=-1), mc)
    step *= 2
  before = _shift(mc, n, 1)  # the composition of devices 0 .. i - 1
  return jnp.where(i == 0, s0, _apply(before[..., :k], s0, precision) + before[..., k:])
