"""Gated MLPs and their activations (docs/model.md#mlps-and-situ): SiTU-GLU (K3) and SwiGLU
(Kimi-Linear).

Every MLP is `down(act(gate(x), up(x)))`. The dense MLP of the first layers and the shared
experts are this module; routed experts use the same `glu` on grouped matmuls (moe.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.layers import Projection, wide_dtype


def situ(a: jax.Array, b: jax.Array, beta: float, linear_beta: float | None) -> jax.Array:
  """SiTU(a, b) = [beta tanh(a/beta) sigmoid(a)] * [lb tanh(b/lb)], in fp32, cast back.

  The tanh clips bound both factors (|gate| <= beta, |up| <= lb), which is what keeps K3's
  activations finite in low precision.
  """
  af, bf = a.astype(wide_dtype(a.dtype)), b.astype(wide_dtype(b.dtype))
  gate = beta * jnp.tanh(af / beta) * jax.nn.sigmoid(af)
  up = bf if linear_beta is None else linear_beta * jnp.tanh(bf / linear_beta)
  return (gate * up).astype(a.dtype)


def glu(cfg: ModelConfig, a: jax.Array, b: jax.Array) -> jax.Array:
  """The configured gated activation of gate pre-activation `a` and up pre-activation `b`."""
  if cfg.hidden_act == "situ":
    return situ(a, b, cfg.situ_beta, cfg.situ_linear_beta)
  return jax.nn.silu(a) * b  # SwiGLU, in the compute dtype as transformers' KimiLinearMLP


class MLP(nnx.Module):
  """Dense gated MLP d -> width -> d (checkpoint names gate_proj / up_proj / down_proj)."""

  def __init__(self, cfg: ModelConfig, ex: Execution, width: int, *, rngs: nnx.Rngs):
    d = cfg.hidden_size
    self.cfg, self.ex = cfg, ex
    self.gate_proj = Projection(ex, "...d,df->...f", (d, width), ("embed", "mlp"),
                                fan_in=d, rngs=rngs)
    self.up_proj = Projection(ex, "...d,df->...f", (d, width), ("embed", "mlp"),
                              fan_in=d, rngs=rngs)
    self.down_proj = Projection(ex, "...f,fd->...d", (width, d), ("mlp", "embed"),
                                fan_in=width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(glu(self.cfg, self.gate_proj(x), self.up_proj(x)))
