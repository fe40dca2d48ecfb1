"""LoRA adapters, MXFP4-packed frozen experts and expert QAT on a built K3 model
(docs/training.md#fine-tuning).

    y = x W + (alpha / r) * (x A) B          A: [in, r] (he-uniform), B: [r, out] (zeros)

`adapt(model, spec, rngs)` changes a built model in place:
  * every `Projection` whose dotted path (e.g. `mla.q_b_proj`, `moe.shared_experts.up_proj`)
    matches a target pattern gets `.lora`, an `nnx.LoRA` stacked over the module's `layers`
    axis. A projection's kernel is [contracted dims..., output dims...] (an einsum with named
    dims), so the adapter works on the flattened contraction and output: `nnx.LoRA(prod(in),
    r, prod(out))`, its variables `nnx.LoRAParam`s;
  * routed experts (`moe.experts.w1|w2|w3`, only when a pattern names them) get one adapter
    per expert: `nnx.LoRAParam` pairs [layers, E, in, r] and [layers, E, r, out], applied to
    the expert weights before the grouped matmul (so dropless, capped and expert-parallel
    paths all see them);
  * `base_experts="mxfp4"` replaces the routed experts' weights by their MXFP4 codes and
    scales (`PackedExperts`, not Params: never trained, no optimizer state; 4.25 bits per
    weight), dequantised per layer at use;
  * `qat=True` makes the routed experts compute with `round_mxfp4(W + delta)` (straight-through
    gradients), which is what `k3jax export --merge-lora` writes back as MXFP4.

Why adapters are attached to the built model rather than declared in ModelConfig: the model,
its checkpoints and its converters stay exactly the pre-trained ones; an adapted model is the
base plus `LoRAParam` leaves, so `nnx.state(model, nnx.LoRAParam)` is the trainable tree and
the rest is frozen by filter.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model.layers import Projection, annotated
from k3jax.model.moe import RoutedExperts
from k3jax.model.transformer import stack
from pallas_kernels import mxfp4 as mx

# attention (MLA and KDA projections), shared experts, dense MLP: what LoRA recipes adapt
DEFAULT_TARGETS = ("mla.*", "kda.*", "moe.shared_experts.*", "dense_mlp.*")
EXPERT_WEIGHTS = ("w1", "w3", "w2")


class PackedExperts(nnx.Variable):
  """Frozen MXFP4 codes / E8M0 scales of routed experts (uint8): not a Param, never trained."""


@dataclasses.dataclass(frozen=True)
class AdaptSpec:
  """How a base model is adapted for fine-tuning (hashable: it keys the train-step cache)."""
  rank: int | None = None             # LoRA rank r; None: no adapters (full fine-tuning)
  alpha: float | None = None          # LoRA alpha; the update is scaled by alpha / r (default r)
  targets: tuple[str, ...] = DEFAULT_TARGETS  # fnmatch patterns over projection paths
  base_experts: str = "float"         # float | mxfp4 (routed experts held as packed codes)
  qat: bool = False                   # routed experts forward with MXFP4-rounded weights

  @property
  def scale(self) -> float:
    return (self.alpha if self.alpha is not None else self.rank) / self.rank

  @property
  def lora(self) -> bool:
    return self.rank is not None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self) | {"targets": list(self.targets)}


def _dotted(path) -> str:
  return ".".join(str(p) for p in path)


def projection_paths(model: nnx.Module) -> dict[str, Projection]:
  return {_dotted(p): m for p, m in nnx.iter_modules(model) if isinstance(m, Projection)}


def expert_paths(model: nnx.Module) -> dict[str, nnx.Module]:
  return {_dotted(p): m for p, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)}


def matching(spec: AdaptSpec, model: nnx.Module) -> tuple[list[str], list[str]]:
  """(projection paths, routed expert weight paths) the target patterns select. A pattern
  that selects nothing is an error: a typo would otherwise train nothing it names."""
  names = list(projection_paths(model))
  experts = [f"{p}.{w}" for p in expert_paths(model) for w in EXPERT_WEIGHTS]
  chosen_p, chosen_e = set(), set()
  for pattern in spec.targets:
    hit_p = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
    hit_e = {n for n in experts if fnmatch.fnmatchcase(n, pattern)}
    if not hit_p and not hit_e:
      raise ValueError(f"--lora-targets {pattern!r} matches no projection (e.g. "
                       f"{', '.join(sorted(names)[:3])}, {experts[0] if experts else ''})")
    chosen_p |= hit_p
    chosen_e |= hit_e
  return sorted(chosen_p), sorted(chosen_e)


def _split_dims(eq: str, kernel_shape) -> tuple[int, int]:
  """How many leading kernel dims are contracted with the input (the rest are outputs)."""
  lhs, rest = eq.split(",")
  rhs = rest.split("->")[0]
  n_in = sum(c in lhs for c in rhs)
  assert all(c in lhs for c in rhs[:n_in]) and not any(c in lhs for c in rhs[n_in:]), eq
  return n_in


def _names(kernel: nnx.Variable) -> tuple:
  return tuple(kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim)


def _attach_projection(proj: Projection, spec: AdaptSpec, rngs: nnx.Rngs, dtype) -> None:
  names = _names(proj.kernel)
  stacked = names[0] == "layers"
  shape = proj.kernel.shape[1:] if stacked else proj.kernel.shape
  own = names[1:] if stacked else names
  n_in = _split_dims(proj.eq, shape)
  fan_in, fan_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
  # a flattened side keeps its logical name only when it is one named dim
  in_name = own[0] if n_in == 1 else None
  out_name = own[n_in] if len(own) - n_in == 1 else None

  def make(r: nnx.Rngs) -> nnx.LoRA:
    return nnx.LoRA(fan_in, spec.rank, fan_out, dtype=proj.dtype, param_dtype=dtype, rngs=r,
                    a_metadata={"out_sharding": (in_name, None), "eager_sharding": False},
                    b_metadata={"out_sharding": (None, out_name), "eager_sharding": False})

  if stacked:
    proj.lora = nnx.data(stack(proj.kernel.shape[0], make, rngs))
  else:
    proj.lora = nnx.data(make(rngs))
  proj.lora_scale = spec.scale
  proj.lora_in_dims = n_in


def dense_names(ex, weight: str) -> tuple:
  """The logical names [..., in, out] of a routed expert weight, held dense or packed (whose
  codes are [..., out, in/2])."""
  if hasattr(ex, weight):
    return _names(getattr(ex, weight))
  names = _names(getattr(ex, f"{weight}_packed"))
  return (*names[:-2], names[-1], names[-2])


def expert_shape(ex, weight: str) -> tuple[int, ...]:
  """[..., in, out] of a routed expert weight, held dense or packed."""
  if hasattr(ex, weight):
    return tuple(getattr(ex, weight).shape)
  codes = getattr(ex, f"{weight}_packed")
  return (*codes.shape[:-2], 2 * codes.shape[-1], codes.shape[-2])


def _attach_expert(ex, weight: str, names: tuple, spec: AdaptSpec, rngs: nnx.Rngs,
                   dtype) -> None:
  w = expert_shape(ex, weight)  # (layers, E, in, out)
  a = nnx.initializers.he_uniform()(rngs.params(), (*w[:-1], spec.rank), dtype)
  b = jnp.zeros((*w[:-2], spec.rank, w[-1]), dtype)
  setattr(ex, f"{weight}_lora_a", nnx.LoRAParam(a, out_sharding=(*names[:-1], None),
                                                eager_sharding=False))
  setattr(ex, f"{weight}_lora_b", nnx.LoRAParam(b, out_sharding=(*names[:-2], None, names[-1]),
                                                eager_sharding=False))
  ex.lora_scale = spec.scale


def pack_experts(ex, names_of: dict[str, tuple]) -> None:
  """Replace a RoutedExperts' weights [layers, E, in, out] by MXFP4 codes + scales [layers, E,
  out, in/2 | in/32] (the checkpoint's orientation; exact for weights that are MXFP4 values, as
  the released checkpoint's are, others are rounded). Traceable: works under eval_shape/jit."""
  for weight in EXPERT_WEIGHTS:
    var = getattr(ex, weight)
    codes, scales = _quantize_by_layer(var[...])
    names = names_of[weight]
    # the checkpoint's orientation [out, in/2]; the scales [out, in/32] are split along `in`
    # with the codes when `in` is the experts' F and its groups of 32 divide over `tensor`
    # (w2: what expert_parallel's shard_map hands each rank anyway), and whole along h (7168
    # / 32 = 224 groups, which fsdp need not divide)
    scale_in = "moe_mlp_groups" if names[-2] == "moe_mlp" else None
    for suffix, value, last in (("_packed", codes, names[-2]), ("_scale", scales, scale_in)):
      setattr(ex, weight + suffix, PackedExperts(value, out_sharding=(*names[:-2], names[-1],
                                                                      last),
                                                  eager_sharding=False))
    delattr(ex, weight)


def _quantize_by_layer(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """mx.quantize of stacked weights [layers, ..., in, out], one layer at a time (the stack
  axis is never sharded): its temporaries, about two float copies of what it packs, then span
  one layer's experts instead of the whole stack, which under jit on a mesh held twice a
  process's expert shards beside them (docs/sharding.md#placement)."""
  return jax.lax.map(mx.quantize, w) if w.ndim > 2 else mx.quantize(w)


def adapt(model: nnx.Module, spec: AdaptSpec, rngs: nnx.Rngs) -> nnx.Module:
  """Attach what `spec` asks for to `model` (in place; returned for chaining)."""
  if spec.lora and spec.rank <= 0:
    raise ValueError(f"--lora rank must be > 0, got {spec.rank}")
  dtype = model.ex.jnp_param_dtype
  experts = expert_paths(model)
  names = {p: {w: dense_names(ex, w) for w in EXPERT_WEIGHTS} for p, ex in experts.items()}
  if spec.base_experts == "mxfp4":
    for path, ex in experts.items():
      if hasattr(ex, EXPERT_WEIGHTS[0]):  # not already packed (read packed from a folder)
        pack_experts(ex, names[path])
  elif spec.base_experts != "float":
    raise ValueError(f"--base-experts {spec.base_experts!r}: expected float or mxfp4")
  for ex in experts.values():
    ex.qat = spec.qat
  if spec.lora:
    projections = projection_paths(model)
    chosen_p, chosen_e = matching(spec, model)
    for path in chosen_p:
      _attach_projection(projections[path], spec, rngs, dtype)
    for path in chosen_e:
      owner, weight = path.rsplit(".", 1)
      _attach_expert(experts[owner], weight, names[owner][weight], spec, rngs, dtype)
  return model


def projection_delta(proj: Projection) -> jax.Array:
  """scale * A @ B reshaped to the kernel's shape (stacked when the kernel is)."""
  a, b = proj.lora.lora_a[...], proj.lora.lora_b[...]
  delta = jnp.einsum("...ir,...ro->...io", a, b, precision=jax.lax.Precision.HIGHEST)
  return (proj.lora_scale * delta).reshape(proj.kernel.shape).astype(proj.kernel.dtype)


def merge(model: nnx.Module) -> nnx.Module:
  """A copy of an adapted model with every adapter folded into its weights (W + scale A B,
  in the weights' dtype) and the routed experts as the forward sees them (dequantised,
  MXFP4-rounded under QAT): the plain model that computes what the adapted one computes."""
  model = nnx.clone(model)
  dtype = model.ex.jnp_param_dtype
  for proj in projection_paths(model).values():
    if proj.lora is not None:
      proj.kernel[...] = proj.kernel[...] + projection_delta(proj)
      proj.lora = nnx.data(None)
  for ex in expert_paths(model).values():
    _fold_experts(ex, dtype)
  return model


def _fold_experts(ex, dtype) -> dict[str, tuple]:
  """Replace a RoutedExperts' weights (dense or packed, adapters, QAT) by the dense weights its
  forward multiplies by; returns their logical names."""
  names = {}
  for weight in EXPERT_WEIGHTS:
    names[weight] = dense_names(ex, weight)
    w = ex.weight(weight).astype(dtype)
    for suffix in ("", "_packed", "_scale", "_lora_a", "_lora_b"):
      if hasattr(ex, weight + suffix):
        delattr(ex, weight + suffix)
    setattr(ex, weight, annotated(w, names[weight]))
  ex.qat, ex.lora_scale = False, None
  return names


def has_qat(model: nnx.Module) -> bool:
  return any(ex.qat for ex in expert_paths(model).values())


def pack_qat_experts(model: nnx.Module) -> nnx.Module:
  """`model` (in place; returned) with every routed expert under QAT held as what its forward
  multiplies by, round_mxfp4(W + scale A B), in MXFP4 codes and scales (exact: the values are
  MXFP4's, and quantising them again gives the same codes), with no QAT and no expert adapters:
  the experts `k3jax export --merge-lora` writes. Everything else (other adapters included)
  stays as it is. What the serving engine runs for a QAT policy: the trained model, packed."""
  for ex in expert_paths(model).values():
    if ex.qat:
      pack_experts(ex, _fold_experts(ex, model.ex.jnp_param_dtype))
  return model
