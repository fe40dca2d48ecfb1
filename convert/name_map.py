"""The one declarative map between official checkpoint names and the k3jax parameter tree.

Each `Entry` says: the HF name (relative to the model prefix, `{i}` = layer, `{e}` = expert),
the k3jax path(s) it fills, which stack it lives in (so the layer index becomes a stack index),
the stored HF dtype, and a layout transform with its inverse. Conversion in both directions
and the in-memory loader are driven by this table alone.

k3jax stores kernels as [in..., out...] with explicit head axes; HF stores torch Linear
weights as [out, in]. The one structural difference: MLA's kv_b_proj [H*(nope+v), kv_lora]
is held as two per-head projections k_b [kv_lora, H, nope] and v_b [kv_lora, H, v].

Dialects. Names are relative to a prefix that depends on the layout (`DIALECTS`): the official
K3 release nests the text model under `language_model.`; Kimi-Linear (the official 48B folder,
and what transformers' `KimiLinearForCausalLM.save_pretrained` writes) uses `model.`. One
difference inside the model: transformers renames every `mlp.` to `block_sparse_moe.` when it
saves (its conversion mapping, reverted), so its dense layer 0 is `block_sparse_moe.gate_proj`;
an entry lists such spellings in `alt`, and a checkpoint must hold exactly one of them.

Routed experts are stored either as `.weight` (bf16/f32) or, when `Entry.mxfp4` is set, as
MXFP4 `.weight_packed` + `.weight_scale` (decided per checkpoint from the tensors present).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Literal

import numpy as np

from k3jax.config import ModelConfig

Scope = Literal["global", "layer", "kda", "mla", "dense", "moe", "expert"]
Arrays = tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
  hf: str
  paths: tuple[tuple[str, ...], ...]
  scope: Scope
  to_k3jax: Callable[[np.ndarray, ModelConfig], Arrays]
  to_hf: Callable[[Arrays, ModelConfig], np.ndarray]
  hf_dtype: Literal["bf16", "f32"] = "bf16"
  when: Callable[[ModelConfig], bool] = lambda cfg: True
  alt: tuple[str, ...] = ()   # other spellings of the same tensor (see the module docstring)
  mxfp4: bool = False         # may be stored as MXFP4 codes + scales


# ---- layout transforms (HF array, config) -> k3jax arrays, and back ---------------------------

def _same():
  return (lambda a, c: (a,)), (lambda t, c: t[0])


def _vec_from_row():  # [1, d] pseudo-query -> [d]
  return (lambda a, c: (a.reshape(-1),)), (lambda t, c: t[0].reshape(1, -1))


_TILE = 512


def transpose(a: np.ndarray) -> np.ndarray:
  """a.T of a 2-D array as a C-contiguous copy, made tile by tile: numpy's plain copy of a
  transposed array strides through memory and runs several times slower on big bf16 matrices
  (docs/benchmarks.md#development-measurements). Small or zero-stride arrays (shape
  computations) stay a view."""
  if a.size < _TILE * _TILE or 0 in a.strides:
    return a.T
  # as plain unsigned ints: numpy has no fast copy loop for ml_dtypes' bfloat16
  bits = a.view(f"u{a.itemsize}") if a.itemsize in (1, 2, 4, 8) else a
  out = np.empty(a.shape[::-1], bits.dtype)
  for i in range(0, a.shape[0], _TILE):
    for j in range(0, a.shape[1], _TILE):
      out[j:j + _TILE, i:i + _TILE] = bits[i:i + _TILE, j:j + _TILE].T
  return out.view(a.dtype)


def _linear(out_shape: Callable[[ModelConfig], tuple[int, ...]] | None = None,
            in_shape: Callable[[ModelConfig], tuple[int, ...]] | None = None):
  """torch Linear [out, in] <-> k3jax [in..., out...] (optionally splitting in/out dims)."""
  def fwd(a, c):
    o = out_shape(c) if out_shape else (a.shape[0],)
    i = in_shape(c) if in_shape else (a.shape[1],)
    return (transpose(a).reshape(*i, *o),)

  def inv(t, c):
    k = t[0]
    n_in = len(in_shape(c)) if in_shape else 1
    fan_in = int(np.prod(k.shape[:n_in]))
    return transpose(k.reshape(fan_in, -1))
  return fwd, inv


def _kda_heads(c):
  return (c.kda_num_heads, c.kda_head_dim)


def _conv():  # [H*K, 1, taps] <-> [H, K, taps]
  return ((lambda a, c: (a.reshape(c.kda_num_heads, c.kda_head_dim, -1),)),
          (lambda t, c: t[0].reshape(-1, 1, t[0].shape[-1])))


def _a_log():
  """K3 stores A_log as [head_dim] with the H real values first and zero padding; Kimi-Linear
  as [1, 1, H, 1]. Non-zero padding means the file is not what we think it is: refuse."""
  def fwd(a, c):
    h = c.kda_num_heads
    if a.ndim == 4:
      return (a.reshape(h),)
    if a.ndim != 1 or a.shape[0] < h:
      raise ValueError(f"A_log has shape {a.shape}, expected [{c.kda_head_dim}] or [1,1,{h},1]")
    if np.any(a[h:] != 0):
      raise ValueError(f"A_log padding beyond the first {h} entries is not zero")
    return (a[:h],)

  def inv(t, c):
    if c.kda_gate == "softplus":
      return t[0].reshape(1, 1, -1, 1)
    out = np.zeros((max(c.kda_head_dim, c.kda_num_heads),), t[0].dtype)
    out[: c.kda_num_heads] = t[0]
    return out
  return fwd, inv


def _heads_vec():  # [H*K] <-> [H, K]
  return ((lambda a, c: (a.reshape(c.kda_num_heads, c.kda_head_dim),)),
          (lambda t, c: t[0].reshape(-1)))


def _kv_b():
  """[H*(nope+v), kv_lora] <-> k_b [kv_lora, H, nope], v_b [kv_lora, H, v]."""
  def fwd(a, c):
    w = a.reshape(c.mla_num_heads, c.qk_nope_head_dim + c.v_head_dim, -1).transpose(2, 0, 1)
    return w[..., : c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

  def inv(t, c):
    w = np.concatenate(t, axis=-1)  # [kv_lora, H, nope+v]
    return w.transpose(1, 2, 0).reshape(-1, w.shape[0])
  return fwd, inv


def _e(hf, paths, scope, transform, **kw) -> Entry:
  fwd, inv = transform
  paths = tuple(tuple(p.split(".")) for p in (paths if isinstance(paths, tuple) else (paths,)))
  return Entry(hf, paths, scope, fwd, inv, **kw)


def _mla_q_heads(c):
  return (c.mla_num_heads, c.qk_head_dim)


def _mla_v_heads(c):
  return (c.mla_num_heads, c.v_head_dim)


_attn_res = lambda c: c.attn_res_block_size is not None
_latent = lambda c: c.latent_size is not None

ENTRIES: tuple[Entry, ...] = (
    # global
    _e("embed_tokens.weight", "embed", "global", _same()),
    _e("norm.weight", "final_norm.weight", "global", _same()),
    _e("output_attn_res_norm.weight", "output_res.norm", "global", _same(), when=_attn_res),
    _e("output_attn_res_proj.weight", "output_res.proj", "global", _vec_from_row(),
       when=_attn_res),
    _e("lm_head.weight", "lm_head", "global", _linear(),
       when=lambda c: not c.tie_word_embeddings),
    # every layer
    _e("layers.{i}.input_layernorm.weight", "layers.input_norm.weight", "layer", _same()),
    _e("layers.{i}.post_attention_layernorm.weight", "layers.post_attention_norm.weight",
       "layer", _same()),
    _e("layers.{i}.self_attention_res_norm.weight", "layers.attn_res.norm", "layer", _same(),
       when=_attn_res),
    _e("layers.{i}.self_attention_res_proj.weight", "layers.attn_res.proj", "layer",
       _vec_from_row(), when=_attn_res),
    _e("layers.{i}.mlp_res_norm.weight", "layers.mlp_res.norm", "layer", _same(), when=_attn_res),
    _e("layers.{i}.mlp_res_proj.weight", "layers.mlp_res.proj", "layer", _vec_from_row(),
       when=_attn_res),
    # KDA
    _e("layers.{i}.self_attn.q_proj.weight", "kda.q_proj.kernel", "kda", _linear(_kda_heads)),
    _e("layers.{i}.self_attn.k_proj.weight", "kda.k_proj.kernel", "kda", _linear(_kda_heads)),
    _e("layers.{i}.self_attn.v_proj.weight", "kda.v_proj.kernel", "kda", _linear(_kda_heads)),
    _e("layers.{i}.self_attn.q_conv1d.weight", "kda.q_conv", "kda", _conv(), hf_dtype="f32"),
    _e("layers.{i}.self_attn.k_conv1d.weight", "kda.k_conv", "kda", _conv(), hf_dtype="f32"),
    _e("layers.{i}.self_attn.v_conv1d.weight", "kda.v_conv", "kda", _conv(), hf_dtype="f32"),
    _e("layers.{i}.self_attn.f_a_proj.weight", "kda.f_a_proj.kernel", "kda", _linear()),
    _e("layers.{i}.self_attn.f_b_proj.weight", "kda.f_b_proj.kernel", "kda",
       _linear(_kda_heads)),
    _e("layers.{i}.self_attn.A_log", "kda.A_log", "kda", _a_log(), hf_dtype="f32"),
    _e("layers.{i}.self_attn.dt_bias", "kda.dt_bias", "kda", _heads_vec(), hf_dtype="f32"),
    _e("layers.{i}.self_attn.b_proj.weight", "kda.b_proj.kernel", "kda", _linear()),
    _e("layers.{i}.self_attn.g_proj.weight", "kda.g_proj.kernel", "kda", _linear(_kda_heads),
       when=lambda c: c.kda_full_rank_output_gate),
    _e("layers.{i}.self_attn.g_a_proj.weight", "kda.g_a_proj.kernel", "kda", _linear(),
       when=lambda c: not c.kda_full_rank_output_gate),
    _e("layers.{i}.self_attn.g_b_proj.weight", "kda.g_b_proj.kernel", "kda",
       _linear(_kda_heads), when=lambda c: not c.kda_full_rank_output_gate),
    _e("layers.{i}.self_attn.o_norm.weight", "kda.o_norm", "kda", _same(), hf_dtype="f32"),
    _e("layers.{i}.self_attn.o_proj.weight", "kda.o_proj.kernel", "kda",
       _linear(in_shape=_kda_heads)),
    # MLA
    _e("layers.{i}.self_attn.q_a_proj.weight", "mla.q_a_proj.kernel", "mla", _linear(),
       when=lambda c: c.q_lora_rank is not None),
    _e("layers.{i}.self_attn.q_a_layernorm.weight", "mla.q_a_norm.weight", "mla", _same(),
       when=lambda c: c.q_lora_rank is not None),
    _e("layers.{i}.self_attn.q_b_proj.weight", "mla.q_b_proj.kernel", "mla",
       _linear(_mla_q_heads), when=lambda c: c.q_lora_rank is not None),
    _e("layers.{i}.self_attn.q_proj.weight", "mla.q_proj.kernel", "mla", _linear(_mla_q_heads),
       when=lambda c: c.q_lora_rank is None),
    _e("layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "mla.kv_a_proj.kernel", "mla",
       _linear()),
    _e("layers.{i}.self_attn.kv_a_layernorm.weight", "mla.kv_a_norm.weight", "mla", _same()),
    _e("layers.{i}.self_attn.kv_b_proj.weight", ("mla.k_b_proj.kernel", "mla.v_b_proj.kernel"),
       "mla", _kv_b()),
    _e("layers.{i}.self_attn.g_proj.weight", "mla.g_proj.kernel", "mla", _linear(_mla_v_heads),
       when=lambda c: c.mla_output_gate),
    _e("layers.{i}.self_attn.o_proj.weight", "mla.o_proj.kernel", "mla",
       _linear(in_shape=_mla_v_heads)),
    # dense MLP
    _e("layers.{i}.mlp.gate_proj.weight", "dense_mlp.gate_proj.kernel", "dense", _linear(),
       alt=("layers.{i}.block_sparse_moe.gate_proj.weight",)),
    _e("layers.{i}.mlp.up_proj.weight", "dense_mlp.up_proj.kernel", "dense", _linear(),
       alt=("layers.{i}.block_sparse_moe.up_proj.weight",)),
    _e("layers.{i}.mlp.down_proj.weight", "dense_mlp.down_proj.kernel", "dense", _linear(),
       alt=("layers.{i}.block_sparse_moe.down_proj.weight",)),
    # MoE
    _e("layers.{i}.block_sparse_moe.gate.weight", "moe.gate.kernel", "moe", _linear()),
    _e("layers.{i}.block_sparse_moe.gate.e_score_correction_bias", "moe.gate.bias", "moe",
       _same(), hf_dtype="f32"),
    _e("layers.{i}.block_sparse_moe.routed_expert_down_proj.weight", "moe.routed_down.kernel",
       "moe", _linear(), when=_latent),
    _e("layers.{i}.block_sparse_moe.routed_expert_norm.weight", "moe.latent_norm.weight", "moe",
       _same(), when=lambda c: c.latent_size is not None and c.latent_norm),
    _e("layers.{i}.block_sparse_moe.routed_expert_up_proj.weight", "moe.routed_up.kernel", "moe",
       _linear(), when=_latent),
    _e("layers.{i}.block_sparse_moe.shared_experts.gate_proj.weight",
       "moe.shared_experts.gate_proj.kernel", "moe", _linear(),
       when=lambda c: c.num_shared_experts > 0),
    _e("layers.{i}.block_sparse_moe.shared_experts.up_proj.weight",
       "moe.shared_experts.up_proj.kernel", "moe", _linear(),
       when=lambda c: c.num_shared_experts > 0),
    _e("layers.{i}.block_sparse_moe.shared_experts.down_proj.weight",
       "moe.shared_experts.down_proj.kernel", "moe", _linear(),
       when=lambda c: c.num_shared_experts > 0),
    # routed experts: `.weight` (bf16) or `.weight_packed` + `.weight_scale` (MXFP4)
    _e("layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "moe.experts.w1", "expert",
       _linear(), mxfp4=True),
    _e("layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "moe.experts.w3", "expert",
       _linear(), mxfp4=True),
    _e("layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "moe.experts.w2", "expert",
       _linear(), mxfp4=True),
)


@dataclasses.dataclass(frozen=True)
class Dialect:
  """Where a layout puts the text model's tensors."""
  name: str
  prefix: str   # before every model tensor name
  head: str     # full name of lm_head


DIALECTS = {
    "k3": Dialect("k3", "language_model.model.", "language_model.lm_head.weight"),
    "kimi_linear": Dialect("kimi_linear", "model.", "lm_head.weight"),
}
# What an MXFP4 expert `.weight` becomes on disk.
PACKED, SCALE = ".weight_packed", ".weight_scale"


def full_name(stem: str, dialect: Dialect) -> str:
  return dialect.head if stem == "lm_head.weight" else dialect.prefix + stem


@dataclasses.dataclass(frozen=True)
class Slot:
  """One HF tensor of one checkpoint: its name(s) and where its arrays go in k3jax."""
  entry: Entry
  hf_name: str                  # primary spelling, relative to the dialect prefix
  index: tuple[int, ...]        # leading stack indices ((), (j,), or (j, expert))
  layer: int | None = None      # decoder layer, None for the global tensors
  alt_names: tuple[str, ...] = ()

  @property
  def names(self) -> tuple[str, ...]:
    return (self.hf_name, *self.alt_names)


def _slot(entry: Entry, index: tuple[int, ...], layer: int | None, **fmt) -> Slot:
  return Slot(entry, entry.hf.format(**fmt), index, layer,
              tuple(a.format(**fmt) for a in entry.alt))


def slots(cfg: ModelConfig, layers: range | None = None) -> Iterator[Slot]:
  """Every HF tensor `cfg` has (its layers optionally restricted to `layers`), in checkpoint
  order: embedding, layers, then norm / output AttnRes / head."""
  layers = range(cfg.num_layers) if layers is None else layers
  stacks = {"kda": cfg.kda_layers, "mla": cfg.mla_layers, "dense": cfg.dense_layers,
            "moe": cfg.moe_layers, "expert": cfg.moe_layers}
  active = [e for e in ENTRIES if e.when(cfg)]
  for e in active:
    if e.scope == "global" and e.hf.startswith("embed"):
      yield _slot(e, (), None)
  for i in layers:
    for e in active:
      if e.scope == "layer":
        yield _slot(e, (i,), i, i=i)
      elif e.scope in stacks and i in stacks[e.scope]:
        j = stacks[e.scope].index(i)
        if e.scope == "expert":
          for x in range(cfg.num_experts):
            yield _slot(e, (j, x), i, i=i, e=x)
        else:
          yield _slot(e, (j,), i, i=i)
  for e in active:
    if e.scope == "global" and not e.hf.startswith("embed"):
      yield _slot(e, (), None)


def hf_shape(entry: Entry, cfg: ModelConfig, k3jax_shapes: dict[tuple[str, ...], tuple[int, ...]]
             ) -> tuple[int, ...]:
  """The HF shape of one tensor of `entry`, found by running the entry's own inverse transform
  on zero-stride placeholder arrays of the k3jax shapes (one stack entry each): no second
  table of shapes that could drift from the transforms."""
  n_lead = {"global": 0, "expert": 2}.get(entry.scope, 1)
  fakes = tuple(np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), k3jax_shapes[p][n_lead:],
                                                (0,) * (len(k3jax_shapes[p]) - n_lead))
                for p in entry.paths)
  return tuple(entry.to_hf(fakes, cfg).shape)
