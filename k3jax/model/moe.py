"""Router, routed experts and the Stable LatentMoE block (docs/model.md#router-and-latentmoe).

Dropless: every selected (token, expert) pair is computed. The pairs are sorted by expert and
run as grouped matmuls (`grouped_matmul`: megablox's Pallas kernels on TPU, `jax.lax.ragged_dot`
on GPU, padded tiles on CPU), never as a loop over all experts. Experts held as MXFP4 codes
(`lora.adapt(base_experts="mxfp4")`, `convert.load(keep_packed=True)`) stay packed: their
grouped matmuls dequantise a tile at a time (k3jax/model/expert_weights.py). Traced under a
k3jax device mesh (`jax.set_mesh`), the routed experts run expert-parallel inside `shard_map`
(k3jax/model/expert_parallel.py); an optional capacity factor (`moe_capacity_factor`) drops and
counts the pairs past each expert's cap.

    s = sigmoid(x W_r)                           # fp32 [N, E]
    T = topk(s + b, k)                           # b: router bias, set by Quantile Balancing
    p = s[T] / (sum s[T] + 1e-20) * routed_scaling_factor
    z = down(x)  (d -> l);  u = sum_{e in T} p_e E_e(z)  (fp32 accumulation)
    y = up(RMSNorm(u)) + Shared(x)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model import expert_parallel, expert_weights
from k3jax.model.expert_weights import ExpertWeights
from k3jax.model.layers import Projection, RMSNorm, annotated, fan_in_normal, make_param, wide_dtype
from k3jax.model.mlp import MLP, glu
from k3jax.model.quantile_balancing import quantile_balancing_bias  # noqa: F401 - re-exported
from pallas_kernels import mxfp4
from sharding.activations import constrain


class RouterBias(nnx.Variable):
  """`e_score_correction_bias`: steers selection only; set by Quantile Balancing, never by
  gradients, so it is deliberately not an nnx.Param (optimizers never see it)."""


class Routing(NamedTuple):
  scores_ne: jax.Array   # unbiased router scores s, fp32 [N, E]
  experts_nk: jax.Array  # selected experts T, int32 [N, k]
  weights_nk: jax.Array  # routing weights p, fp32 [N, k]
  dropped_pairs: jax.Array | None = None  # int32 []: selected pairs not computed (capacity);
                                          # set by MoE, 0 when dropless


class Router(nnx.Module):
  """Sigmoid router with bias-steered top-k selection (checkpoint `gate.weight`, `gate.
  e_score_correction_bias`). Always fp32: a bf16 router flips near-tied expert choices."""

  def __init__(self, cfg: ModelConfig, ex: Execution, *, rngs: nnx.Rngs):
    d, e = cfg.hidden_size, cfg.num_experts
    self.cfg = cfg
    self.kernel = make_param(rngs, fan_in_normal(d), (d, e), ("embed", "expert_scores"),
                             ex.jnp_param_dtype)
    self.bias = annotated(jnp.zeros((e,), jnp.float32), ("expert_scores",), RouterBias)

  def __call__(self, x_nd: jax.Array) -> Routing:
    return route(self.cfg, x_nd, self.kernel[...], self.bias[...])


def route(cfg: ModelConfig, x_nd: jax.Array, kernel_de: jax.Array, bias_e: jax.Array) -> Routing:
  """The router as a function of its weights (expert parallelism calls it per device)."""
  wide = wide_dtype(x_nd.dtype)
  logits = jnp.einsum("nd,de->ne", x_nd.astype(wide), kernel_de.astype(wide),
                      precision=jax.lax.Precision.HIGHEST)
  scores = jax.nn.sigmoid(logits)
  _, experts = jax.lax.top_k(scores + bias_e.astype(wide), cfg.num_experts_per_token)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return Routing(scores, experts.astype(jnp.int32), weights * cfg.routed_scaling_factor)


class RoutedExperts(nnx.Module):
  """E gated MLPs of width F on inputs of width h (the latent l for K3), stacked for grouped
  matmuls: w1 (gate) and w3 (up) [E, h, F], w2 (down) [E, F, h]."""

  def __init__(self, cfg: ModelConfig, ex: Execution, width_in: int, *, rngs: nnx.Rngs):
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    in_name = expert_parallel.expert_input_name(cfg)
    self.cfg, self.ex = cfg, ex
    pd = ex.jnp_param_dtype
    self.w1 = make_param(rngs, fan_in_normal(width_in), (e, width_in, f),
                         ("experts", in_name, "moe_mlp"), pd)
    self.w3 = make_param(rngs, fan_in_normal(width_in), (e, width_in, f),
                         ("experts", in_name, "moe_mlp"), pd)
    self.w2 = make_param(rngs, fan_in_normal(f), (e, f, width_in),
                         ("experts", "moe_mlp", in_name), pd)
    self.in_name = in_name
    self.qat = False         # set by model/lora.adapt: forward with MXFP4-rounded weights
    self.lora_scale = None   # set by model/lora.adapt with per-expert adapters

  def weight(self, name: str) -> jax.Array:
    """The expert weights [..., in, out] as one dense array: the stored ones (dequantised when
    held as MXFP4 codes), plus the LoRA update scale * A B, MXFP4-rounded under QAT. What the
    forward multiplies by, except over packed codes without QAT (`operands`)."""
    adapted = self.qat or hasattr(self, f"{name}_lora_a")
    dt = self.ex.jnp_param_dtype if adapted else self.ex.jnp_dtype
    if hasattr(self, name):
      w = getattr(self, name)[...]
    else:  # frozen MXFP4 base: dequantised per use (exact)
      w = mxfp4.dequantize(getattr(self, f"{name}_packed")[...],
                           getattr(self, f"{name}_scale")[...], dt)
    if hasattr(self, f"{name}_lora_a"):
      a, b = getattr(self, f"{name}_lora_a")[...], getattr(self, f"{name}_lora_b")[...]
      w = w + self.lora_scale * jnp.einsum("...ir,...ro->...io", a, b,
                                           precision=jax.lax.Precision.HIGHEST).astype(w.dtype)
    if self.qat:
      w = mxfp4.round_mxfp4(w)
    return w

  def operands(self, name: str) -> ExpertWeights:
    """Weight `name` as the grouped matmuls take it, in the compute dtype: held as MXFP4 codes
    (and not under QAT, which rounds the whole W + scale A B), the codes and scales as they are,
    with the adapters beside them; else the dense `weight(name)`."""
    dt = self.ex.jnp_dtype
    if hasattr(self, name) or self.qat:
      return ExpertWeights(dense=self.weight(name).astype(dt))
    w = ExpertWeights(codes=getattr(self, f"{name}_packed")[...],
                      scales=getattr(self, f"{name}_scale")[...])
    if hasattr(self, f"{name}_lora_a"):
      a, b = getattr(self, f"{name}_lora_a")[...], getattr(self, f"{name}_lora_b")[...]
      w = w._replace(lora_a=a.astype(dt), lora_b=(self.lora_scale * b).astype(dt))
    return w

  def __call__(self, z_nh: jax.Array, routing: Routing) -> jax.Array:
    """sum_k p_k E_{T_k}(z), accumulated in fp32 [N, h] (one device, dropless)."""
    n, k = routing.experts_nk.shape
    e = self.cfg.num_experts
    dt = self.ex.jnp_dtype
    flat_expert = routing.experts_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)     # (token, slot) pairs grouped by expert
    token = order // k
    group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)
    z_mh = z_nh.astype(dt)[token]
    gmm = lambda x, w: expert_weights.matmul(self.ex, x, self.operands(w),
                                             group_sizes)
    y_mh = gmm(glu(self.cfg, gmm(z_mh, "w1"), gmm(z_mh, "w3")), "w2")
    wide = wide_dtype(dt)
    p_m = routing.weights_nk.reshape(-1)[order].astype(wide)
    return jnp.zeros((n, y_mh.shape[-1]), wide).at[token].add(y_mh.astype(wide) * p_m[:, None])


class MoE(nnx.Module):
  """Stable LatentMoE with shared experts (K3), or a plain MoE on the full width (Kimi-Linear,
  `latent_size=None`)."""

  def __init__(self, cfg: ModelConfig, ex: Execution, *, rngs: nnx.Rngs):
    d, l = cfg.hidden_size, cfg.latent_size
    self.cfg, self.ex = cfg, ex
    self.gate = Router(cfg, ex, rngs=rngs)
    if l is not None:
      self.routed_down = Projection(ex, "nd,dl->nl", (d, l), ("embed", "latent"),
                                    fan_in=d, rngs=rngs)
      self.routed_up = Projection(ex, "nl,ld->nd", (l, d), ("latent", "embed"),
                                  fan_in=l, rngs=rngs)
      self.latent_norm = (RMSNorm(ex, l, ("latent",), eps=cfg.rms_norm_eps)
                          if cfg.latent_norm else None)
    self.experts = RoutedExperts(cfg, ex, l if l is not None else d, rngs=rngs)
    self.shared_experts = (MLP(cfg, ex, cfg.shared_intermediate_size, rngs=rngs)
                           if cfg.num_shared_experts else None)

  def __call__(self, x_btd: jax.Array) -> tuple[jax.Array, Routing]:
    b, t, d = x_btd.shape
    x_nd = x_btd.reshape(b * t, d)
    latent = self.cfg.latent_size is not None
    experts = self.experts
    one_device = (expert_parallel.context_mesh() is None
                  and self.ex.moe_capacity_factor is None)
    if not one_device:
      # the rows as routed_experts splits them (over tensor too): the latent projections and
      # the router then run once per row, not on every tensor rank. Pinned whole first: the
      # constraint's transpose pins the cotangent whole there too, so the split stays inside
      # this block (unpinned, XLA carried it into the MLA layer's remat and backward, whose
      # attention then ran on every tensor rank: docs/plan.md#what-got-it-there)
      x_nd = expert_parallel.split_rows(self.cfg, constrain(x_nd, ("tokens", "embed")),
                                        experts.in_name)
    z = self.routed_down(x_nd) if latent else x_nd
    if one_device:
      routing = self.gate(x_nd)
      u, dropped = experts(z, routing), jnp.zeros((), jnp.int32)
    else:  # router, dispatch and experts per device (or capped, on one device)
      u, routed, dropped = expert_parallel.routed_experts(
          self.cfg, self.ex, functools.partial(route, self.cfg), x_nd, z, self.gate.kernel[...],
          self.gate.bias[...], experts.operands("w1"), experts.operands("w3"),
          experts.operands("w2"), in_name=experts.in_name)
      routing = Routing(*routed)
    u = u.astype(x_nd.dtype)  # official: fp32 sum, cast to x's dtype
    if latent:
      if self.latent_norm is not None:
        u = self.latent_norm(u)
      u = self.routed_up(u)
    # routed_up's output on the split rows, then whole (left free, the partitioner gathers u,
    # half y's bytes, and repeats routed_up on every tensor rank)
    u = expert_parallel.split_rows(self.cfg, u, experts.in_name)
    y = constrain(u.reshape(b, t, d), ("batch", "length", "embed"))  # rows whole again
    if self.shared_experts is not None:
      y = y + self.shared_experts(x_btd)
    return y, routing._replace(dropped_pairs=dropped)
