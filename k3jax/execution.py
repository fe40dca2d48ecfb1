"""How a model runs, apart from what it is: dtypes, precision, kernel backends, expert dispatch,
rematerialisation, attention and loss kernels, layer scanning.

`ModelConfig` (k3jax/config.py) holds the architecture, what a checkpoint's config.json says;
`Execution` holds the choices a command makes for one run of it. The same checkpoint trains
with fp32 masters and bf16 compute on a TPU, checks parity in float64 on a CPU, and serves
with bf16 weights, with one `ModelConfig` and three `Execution`s. Every field has a default
that computes the reference numbers (float32, the plain kernels picked by platform, no
remat); the closed choices are str-Enums, so `Remat("full")` and `Remat.FULL == "full"` both
work for values read from flags and JSON.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from k3jax.errors import ConfigError
from pallas_kernels.grouped_matmul import IMPLS as _GROUPED_MATMUL_IMPLS
from pallas_kernels.kda.ops import BACKENDS as _KDA_BACKENDS


class Remat(enum.StrEnum):
  """What each layer's forward keeps for the backward pass."""
  NONE = "none"            # every activation
  FULL = "full"            # only the layer's input; the layer is recomputed
  SAVE_DOTS = "save-dots"  # the outputs of matmuls without batch dims (the projections)
  OFFLOAD = "offload"      # the same, in host memory (pinned_host) instead of HBM
  # full, but MLA's flash attention keeps its output and lse: its backward runs from them,
  # the forward's loops are not run again (k3jax/model/saved_attention.py)
  SAVE_ATTENTION = "save-attention"


class Attention(enum.StrEnum):
  """MLA's training attention."""
  DENSE = "dense"  # the [B, H, T, T] scores: the reference
  FLASH = "flash"  # blockwise online softmax with its own backward (pallas_kernels/flash_attention)


class Precision(enum.StrEnum):
  """jax.lax.Precision of the matmuls; parity work wants HIGHEST."""
  DEFAULT = "default"
  HIGH = "high"
  HIGHEST = "highest"


GroupedMatmul = enum.StrEnum("GroupedMatmul", {n.upper(): n for n in _GROUPED_MATMUL_IMPLS})
GroupedMatmul.__doc__ = ("The routed experts' grouped matmul (pallas_kernels/grouped_matmul): "
                         "ragged_dot, megablox (Pallas TPU) or tiled.")
KdaBackend = enum.StrEnum("KdaBackend", {n.upper(): n for n in _KDA_BACKENDS})
KdaBackend.__doc__ = "The KDA op's backend (pallas_kernels/kda/ops.py)."


class Dispatch(enum.StrEnum):
  """The expert-parallel exchange of routed rows."""
  RAGGED = "ragged"  # jax.lax.ragged_all_to_all: moves only the routed rows
  PADDED = "padded"  # all_to_all of fixed-size per-device buffers (XLA:CPU lacks the ragged one)


_ENUMS = {"matmul_precision": Precision, "kda_backend": KdaBackend,
          "moe_grouped_matmul": GroupedMatmul, "moe_dispatch": Dispatch, "remat": Remat,
          "attention": Attention}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Execution:
  """How to run a model.

  Attributes:
    dtype: compute dtype of activations and matmuls ("float32", "bfloat16", "float64"). Norms,
      AttnRes, the router, SiTU and the KDA state compute in at least float32 whatever it is.
    param_dtype: storage dtype of the parameters.
    matmul_precision: jax.lax.Precision of the matmuls.
    kda_backend: the KDA op's backend; None picks by platform.
    moe_grouped_matmul: the routed experts' grouped matmul; None picks by platform (tiled on
      CPU, megablox on TPU, ragged_dot on GPU).
    moe_capacity_factor: None keeps the routed experts dropless (every selected pair computed,
      exchange buffers sized for the worst case). A float c caps each expert at
      ceil(c * k * n / E) pairs per step, n the tokens of its expert-parallel group; pairs past
      the cap, later tokens first, are dropped and counted (`Routing.dropped_pairs`).
    moe_dispatch: the expert-parallel exchange; None picks by the platform lowered for.
    remat: the per-layer rematerialisation policy.
    loss_chunk: None computes the train loss from the whole [B, T, V] logits; C computes it in
      chunks of C positions with the head inside (no [tokens, vocab] fp32 buffers).
    attention: MLA's training attention.
    attention_block: query and key block of the flash attention (positions).
    scan_layers: run the longest stretch of identical layer units under one lax.scan (compile
      time independent of depth; the same numbers as unrolled).
  """

  dtype: str = "float32"
  param_dtype: str = "float32"
  matmul_precision: Precision = Precision.DEFAULT
  kda_backend: KdaBackend | None = None
  moe_grouped_matmul: GroupedMatmul | None = None
  moe_capacity_factor: float | None = None
  moe_dispatch: Dispatch | None = None
  remat: Remat = Remat.NONE
  loss_chunk: int | None = None
  attention: Attention = Attention.DENSE
  attention_block: int = 512
  scan_layers: bool = True

  def __post_init__(self):
    if isinstance(self.remat, bool) or self.remat is None:  # older configs wrote a bool
      object.__setattr__(self, "remat", Remat.FULL if self.remat else Remat.NONE)
    for name, kind in _ENUMS.items():
      value = getattr(self, name)
      if value is None or isinstance(value, kind):
        continue
      try:
        object.__setattr__(self, name, kind(value))
      except ValueError:
        raise ConfigError(f"unknown {name} {value!r}; choose one of "
                          f"{', '.join(k.value for k in kind)}") from None
    for name in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise ConfigError(f"unknown {name} {getattr(self, name)!r}") from None
    if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
      raise ConfigError(f"moe_capacity_factor must be > 0, got {self.moe_capacity_factor}")
    if self.loss_chunk is not None and self.loss_chunk <= 0:
      raise ConfigError(f"loss_chunk must be > 0, got {self.loss_chunk}")
    if self.attention_block <= 0:
      raise ConfigError(f"attention_block must be > 0, got {self.attention_block}")
    if self.remat == Remat.SAVE_ATTENTION and self.attention != Attention.FLASH:
      raise ConfigError("remat save-attention keeps the flash kernels' output: it needs "
                        f"attention flash, not {self.attention.value}")

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def precision(self) -> jax.lax.Precision:
    return jax.lax.Precision[self.matmul_precision.name]

  def replace(self, **changes: Any) -> Execution:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return {f.name: (v.value if isinstance(v := getattr(self, f.name), enum.Enum) else v)
            for f in dataclasses.fields(self)}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Execution:
    unknown = sorted(set(d) - FIELDS)
    if unknown:
      raise ConfigError(f"unknown execution fields: {', '.join(unknown)}")
    return cls(**d)


FIELDS = frozenset(f.name for f in dataclasses.fields(Execution))

# The numerics of a run by dtype name, as the commands' --dtype flags name them: float64 and
# float32 for exactness work (highest matmul precision), bfloat16 as an accelerator runs.
NUMERICS: dict[str, Execution] = {
    "float64": Execution(dtype="float64", param_dtype="float64",
                         matmul_precision=Precision.HIGHEST),
    "float32": Execution(dtype="float32", param_dtype="float32",
                         matmul_precision=Precision.HIGHEST),
    "bfloat16": Execution(dtype="bfloat16", param_dtype="bfloat16"),
}


def resolve_dtype(name: str) -> str:
  """A --dtype flag's value: "auto" is float32 on a CPU (XLA:CPU has no fast bf16 matmul on most
  CPUs, and fp32 keeps CPU runs exact), bfloat16 on an accelerator."""
  if name != "auto":
    return name
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def split_fields(d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(architecture fields, execution fields) of a flat dict, as k3jax config files written
  before the two were separated hold them together."""
  arch = {k: v for k, v in d.items() if k not in FIELDS}
  return arch, {k: v for k, v in d.items() if k in FIELDS}


def recorded(file: Mapping[str, Any]) -> Execution:
  """The execution a k3jax config file (`{"format": "k3jax", "config": ..., "execution":
  ...}`) records for its weights: its "execution" object; in a file written before the split,
  the execution fields of its "config" (an older `remat` bool included); the defaults when it
  records none (a converted checkpoint)."""
  fields = file.get("execution")
  if fields is None:
    fields = split_fields(file.get("config") or {})[1]
  return Execution.from_dict(fields)
