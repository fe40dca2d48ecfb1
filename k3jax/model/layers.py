"""Shared building blocks: parameter creation with logical axes, projections, RMSNorm.

Every parameter is an `nnx.Param` whose `out_sharding` metadata holds logical axis names only
(see sharding/rules.py); placement is decided by the rules table, never by a layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.execution import Execution

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def fan_in_normal(fan_in: int) -> Initializer:
  """N(0, 1/fan_in): unit-variance outputs for unit-variance inputs."""
  return nnx.initializers.normal(stddev=fan_in**-0.5)


def annotated(value: jax.Array, names: Sequence[str], kind: type = nnx.Param) -> nnx.Variable:
  """A variable carrying logical axis names. Eager sharding stays off: placement is applied
  from the rules table by the caller's mesh set-up, never at construction inside a layer."""
  if value.ndim != len(names):
    raise ValueError(f"shape {value.shape} and logical names {tuple(names)} disagree")
  return kind(value, out_sharding=tuple(names), eager_sharding=False)


def make_param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int],
               names: Sequence[str], dtype) -> nnx.Param:
  return annotated(init(rngs.params(), tuple(shape), dtype), names)


def ones_param(shape: Sequence[int], names: Sequence[str], dtype) -> nnx.Param:
  return annotated(jnp.ones(tuple(shape), dtype), names)


def wide_dtype(dtype) -> jnp.dtype:
  """The dtype of "computed in fp32" steps: float32, or float64 when the model runs in it."""
  return jnp.promote_types(dtype, jnp.float32)


class Projection(nnx.Module):
  """A bias-free linear map written as one einsum with named dims (gemma style).

  `eq` contracts the input with the kernel, e.g. "btd,dhk->bthk". The kernel is stored in
  `param_dtype` and cast to the compute dtype at use, so the master copy can stay fp32.
  """

  def __init__(self, ex: Execution, eq: str, shape: Sequence[int], names: Sequence[str],
               *, fan_in: int, rngs: nnx.Rngs, init: Initializer | None = None):
    self.eq = eq
    self.precision = ex.precision
    self.dtype = ex.jnp_dtype
    self.kernel = make_param(rngs, init or fan_in_normal(fan_in), shape, names,
                             ex.jnp_param_dtype)
    self.lora = nnx.data(None)  # an nnx.LoRA on the flattened in/out dims, set by model/lora.adapt

  def __call__(self, x: jax.Array) -> jax.Array:
    y = flat_einsum(self.eq, x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                    self.precision)
    if self.lora is None:
      return y
    # the contracted dims are x's trailing ones and the kernel's leading ones (gemma style)
    n_in = self.lora_in_dims
    x_flat = x.astype(self.dtype).reshape(*x.shape[:x.ndim - n_in], -1)
    delta = self.lora(x_flat).reshape(y.shape)
    return y + (self.lora_scale * delta).astype(y.dtype)

  def weight(self) -> jax.Array:
    """The kernel this projection applies: W, or W + scale A B under an adapter, for callers
    that use the weight itself rather than the projection (MLA's absorbed products)."""
    w = self.kernel[...]
    if self.lora is None:
      return w
    delta = jnp.einsum("...ir,...ro->...io", self.lora.lora_a[...], self.lora.lora_b[...],
                       precision=jax.lax.Precision.HIGHEST)
    return w + (self.lora_scale * delta).reshape(w.shape).astype(w.dtype)


def flat_einsum(eq: str, x: jax.Array, kernel: jax.Array, precision=None,
                preferred_element_type=None) -> jax.Array:
  """einsum(eq, x, kernel) for a projection (x's trailing dims contracted with the kernel's
  leading ones, the kernel's trailing dims appended to x's leading ones), computed as one
  [tokens, in] @ [in, out] matmul and reshaped back.

  Same product; the reason is the backward. The weight gradient contracts over every leading
  dim of x (batch and positions), and XLA:CPU's dot lowering merges two or more contracted (or
  kernel output) dims by materialising a transposed copy of the activation or its cotangent,
  a strided write far slower than a plain copy. With one contracted dim and one kernel output
  dim no copy is needed (benchmarks/train.py measures the difference:
  docs/benchmarks.md#train-step). The reshapes only merge adjacent dims, so a sharded leading
  dim (batch) or kernel dim (heads) stays the major factor of its merged dim.
  `preferred_element_type`: the product's dtype (the LM head's float32 logits over bf16
  operands: `head_logits`)."""
  lhs, rest = eq.split(",")
  rhs, out = rest.split("->")
  n_in = len([c for c in lhs if c in rhs])
  batch, k_in, k_out = x.shape[:x.ndim - n_in], kernel.shape[:n_in], kernel.shape[n_in:]
  projection = lhs.endswith(rhs[:n_in]) and out == lhs[:len(lhs) - n_in] + rhs[n_in:]
  if not projection or len(batch) == len(k_in) == len(k_out) == 1:  # einsum as written
    return jnp.einsum(eq, x, kernel, precision=precision,
                      preferred_element_type=preferred_element_type)
  with jax.named_scope(eq):  # profiles and HLO op names still show the projection's own eq
    y = jnp.einsum("ni,io->no", x.reshape(-1, math.prod(k_in)),
                   kernel.reshape(math.prod(k_in), -1), precision=precision,
                   preferred_element_type=preferred_element_type)
  return y.reshape(batch + k_out)


def head_logits(eq: str, features: jax.Array, head: jax.Array, precision=None) -> jax.Array:
  """The LM head's logits, features @ head with both in the features' (compute) dtype, produced
  in the wide dtype (float32; float64 for a float64 model): the product is accumulated and
  returned wide, never rounded to the compute dtype first. In bf16 a logit of magnitude >= 16
  would otherwise be rounded to a multiple of 0.125, differently wherever a program fuses the
  head differently (the engine and the trainer: RL's behaviour / target mismatch)."""
  return flat_einsum(eq, features, head.astype(features.dtype), precision,
                     preferred_element_type=wide_dtype(features.dtype))


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) over the last axis, in (at least) fp32."""
  xf = x.astype(wide_dtype(x.dtype))
  return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """y = gamma * (x * rsqrt(mean(x^2) + eps)): normalised in fp32, cast back to the input dtype
  before the gain multiply, exactly as the official KimiRMSNorm (docs/model.md#rmsnorm)."""

  def __init__(self, ex: Execution, size: int, names: Sequence[str], *, eps: float):
    self.eps = eps
    self.weight = ones_param((size,), names, ex.jnp_param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.weight[...].astype(x.dtype) * rms_normalize(x, self.eps).astype(x.dtype)
