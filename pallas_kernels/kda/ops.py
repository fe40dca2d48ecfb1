"""The public KDA op (docs/kernels.md#kda-op): one signature, dispatched to a backend.

    o, s = kda(q, k, v, g, beta, scale=..., initial_state=..., output_final_state=...,
               segment_ids=..., backend=None | <a name in BACKENDS>, interpret=False,
               A_log=..., dt_bias=..., raw=RawInputs(...))

Layouts: q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; beta [B,T,H]; state [B,H,K,V] float32.
`raw` (reference.RawInputs: gate, lower_bound, use_qk_l2norm, l2norm_eps, use_beta_sigmoid)
says how raw inputs become core inputs (reference.prepare_inputs defines it); the gate's
parameters A_log [H] and dt_bias [H,K] are arrays and travel beside it. The bundle's fields are
also taken as keywords (`kda(..., gate="lower_bound", lower_bound=-5.0)`).

The backends, `_REGISTRY` below (each takes the op's signature without `backend`; the Pallas
ones also `interpret`, to run the kernels on a CPU):

  "naive"       reference.naive_kda, the token-by-token recurrence (the definition)
  "chunked"     reference.chunk_kda, the chunked form (docs/kernels.md) written plainly
  "xla_cpu"     xla_cpu.kda_xla_cpu, the chunked form tuned for XLA:CPU with its own backward
  "pallas_tpu"  tpu.kda_tpu, Pallas Mosaic kernels (raw inputs prepared in-kernel)
  "pallas_gpu"  gpu.kda_gpu, Pallas Triton kernels (JAX deprecates Pallas Triton)
  "pallas_mosaic_gpu"  mosaic_gpu.kda_mosaic_gpu, a Pallas Mosaic GPU recurrence kernel for
                sm_90+ (Hopper, Blackwell); K <= 128; backward through reference.chunk_kda;
                a fused Mosaic GPU decode step

On a GPU, backend=None picks "pallas_mosaic_gpu" on sm_90 and newer (where Mosaic GPU runs) when
K fits it, "pallas_gpu" otherwise.

`kda_range` runs one range of a sequence from a zero state and returns, besides its outputs,
how the range depends on the state entering it (its affine map S_out = M S_in + C): what
context parallelism composes over shards (docs/kernels.md#a-range-as-an-affine-map).
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

# public here too (ops.GATES, ops.prepare_inputs), as before the bundle
from pallas_kernels.kda.reference import GATES, RawInputs, prepare_inputs  # noqa: F401 - re-exported


class _Backend(NamedTuple):
  """Where a backend's functions live, as "module:function" under pallas_kernels.kda: imported on
  first use, since a Pallas module does not import on every JAX (Pallas Triton is deprecated,
  Mosaic GPU needs a recent one)."""
  kda: str       # the op: (q, k, v, g, beta, *, scale, initial_state, ..., raw) -> (o, state)
  kda_step: str  # one decode token on prepared inputs: (q, k, v, g, beta, state, *, scale)
  pallas: bool   # both also take `interpret`
  transition: bool = True  # runs `kda_range` (V + K value columns): tested to (see below)


_REGISTRY = {
    # the jnp backends decode with the reference step: one token has no chunk to form
    "naive": _Backend("reference:naive_kda", "reference:kda_step", pallas=False),
    "chunked": _Backend("reference:chunk_kda", "reference:kda_step", pallas=False),
    "xla_cpu": _Backend("xla_cpu:kda_xla_cpu", "reference:kda_step", pallas=False),
    "pallas_tpu": _Backend("tpu:kda_tpu", "tpu:kda_step_tpu", pallas=True),
    # the GPU kernels size their tiles for V = K; a range's V + K columns are not tested there
    "pallas_gpu": _Backend("gpu:kda_gpu", "gpu:kda_step_gpu", pallas=True, transition=False),
    "pallas_mosaic_gpu": _Backend("mosaic_gpu:kda_mosaic_gpu", "mosaic_gpu:kda_step_mosaic_gpu",
                                  pallas=True, transition=False),
}
BACKENDS = tuple(_REGISTRY)
TRANSITION_BACKENDS = tuple(name for name, b in _REGISTRY.items() if b.transition)


def gpu_backend(compute_capability: str | None) -> str:
  """Mosaic GPU needs sm_90+ (TMA, wgmma); older GPUs keep the Triton kernels."""
  try:
    major = int(str(compute_capability).split(".")[0])
  except ValueError:
    return "pallas_gpu"
  return "pallas_mosaic_gpu" if major >= 9 else "pallas_gpu"


def default_backend() -> str:
  """The fastest backend for the default JAX platform."""
  platform = jax.default_backend()
  if platform == "gpu":
    return gpu_backend(getattr(jax.devices()[0], "compute_capability", None))
  return {"tpu": "pallas_tpu"}.get(platform, "xla_cpu")


def _load(where: str):
  """The function at "module:function" under pallas_kernels.kda, or None if its module cannot
  be imported here."""
  module, name = where.split(":")
  try:
    return getattr(importlib.import_module(f"pallas_kernels.kda.{module}"), name)
  except ImportError:  # e.g. a JAX without Pallas Triton (deprecated) or Mosaic GPU
    return None


def _resolve(backend: str | None, which: str, K: int | None = None):
  """(backend name, its `which` function: "kda" or "kda_step"). backend=None: the platform's default
  with its fallbacks, by K (the key size; Mosaic GPU handles K <= mosaic_gpu.MAX_K) and by what
  imports here (a Pallas module that cannot be imported leaves "xla_cpu")."""
  if backend is None:
    backend = default_backend()
    if backend == "pallas_mosaic_gpu" and (
        _load(getattr(_REGISTRY[backend], which)) is None
        or (K is not None and K > _load("mosaic_gpu:MAX_K"))):
      backend = "pallas_gpu"
    if _load(getattr(_REGISTRY[backend], which)) is None:
      backend = "xla_cpu"
  if backend not in _REGISTRY:
    raise ValueError(f"unknown KDA backend {backend!r}; expected one of {BACKENDS}")
  fn = _load(getattr(_REGISTRY[backend], which))
  if fn is None:
    raise ImportError(f"KDA backend {backend!r} is not available in this installation")
  return backend, fn


def _interpret(backend: str, interpret) -> dict:
  return {"interpret": interpret} if _REGISTRY[backend].pallas else {}


def kda_step(q, k, v, g, beta, state, *, scale=None, backend=None, interpret=False):
  """One decode token: q, k, g [B,H,K] (prepared: unit q/k, log decay g); v [B,H,V]; beta
  [B,H]; state [B,H,K,V] -> (o [B,H,V] in v's dtype, new state float32).

  The Pallas backends run one fused kernel that updates the state in place (aliased), so a
  decode step reads and writes the state once; the jnp backends all use reference.kda_step.
  """
  backend, step = _resolve(backend, "kda_step")
  return step(q, k, v, g, beta, state, scale=scale, **_interpret(backend, interpret))


def kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool = False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    raw: RawInputs | None = None,
    **raw_fields,
) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention. Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] or None).

  raw: the raw-input transforms (reference.RawInputs); or its fields as keywords (`gate`,
  `lower_bound`, `use_qk_l2norm`, `l2norm_eps`, `use_beta_sigmoid`), not both. None and no
  keywords: q, k, g, beta arrive prepared.

  backend=None picks "pallas_tpu" on TPU, "pallas_mosaic_gpu" on sm_90+ GPUs (K <= 128),
  "pallas_gpu" on other GPUs and "xla_cpu" elsewhere, falling back to "xla_cpu" when the Pallas
  module cannot be imported. `interpret` is passed to the Pallas kernels (to run them on a CPU).
  """
  if raw is not None and raw_fields:
    raise TypeError(f"kda: pass raw=RawInputs(...) or its fields as keywords, not both "
                    f"(got raw and {sorted(raw_fields)})")
  raw = RawInputs(**raw_fields) if raw is None else raw
  backend, op = _resolve(backend, "kda", K=q.shape[-1])
  raw.check(g, A_log, dt_bias)
  return op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, segment_ids=segment_ids, A_log=A_log,
            dt_bias=dt_bias, raw=raw, **_interpret(backend, interpret))


class RangeMap(NamedTuple):
  """One range of a sequence run from a zero entering state, and how it depends on the state S
  it really enters with (per head; `kda_range`):
      o_t   = o_zero_t + S^T read_t           (read_t = M_t^T scale q_t, M_t the map to t)
      S_out = transition S + offset"""
  o: jax.Array           # [B, T, H, V] outputs from a zero state, in the state's dtype
  read: jax.Array        # [B, T, H, K] what each output reads of the entering state
  offset: jax.Array      # [B, H, K, V] the final state from a zero state (C)
  transition: jax.Array  # [B, H, K, K] the range's linear map of the state (M)


def has_transition(backend: str | None) -> bool:
  """Whether `backend` (None: the platform's default) runs `kda_range`."""
  name = default_backend() if backend is None else backend
  return name in TRANSITION_BACKENDS


def kda_range(q, k, v, g, beta, *, backend: str | None = None, **kwargs) -> RangeMap:
  """The op (`kda`, same arguments but `initial_state` / `output_final_state`) on one range of
  a sequence, as an affine map of the state entering it.

  Every token's update S <- (I - beta k k^T) Diag(e^g) S + beta k v^T is affine in S, and the
  state's value columns evolve independently, so one run of the op with the value columns
  [v | 0] from the state [0 | I] (V + K columns) computes both the zero-state run (the first
  V) and the range's transition M (the last K: the identity carried through every token,
  segment restarts zeroing it as they zero any state). The outputs' last K columns are
  M_t^T scale q_t. Values and outputs are carried in the state's dtype (float32, or float64),
  so a caller completing o_zero + S^T read rounds once, as the op does."""
  for name in ("initial_state", "output_final_state"):
    if name in kwargs:
      raise TypeError(f"kda_range: {name} is not an argument (the range starts from zero)")
  if not has_transition(backend):
    raise ValueError(f"KDA backend {backend or default_backend()!r} does not run a range's "
                     f"transition (one of {', '.join(TRANSITION_BACKENDS)})")
  B, _, H, K = q.shape
  V = v.shape[-1]
  dt = jnp.result_type(jnp.float32, q.dtype, k.dtype, v.dtype)
  v_ext = jnp.concatenate([v.astype(dt), jnp.zeros((*v.shape[:3], K), dt)], axis=-1)
  eye = jnp.broadcast_to(jnp.eye(K, dtype=dt), (B, H, K, K))
  s0 = jnp.concatenate([jnp.zeros((B, H, K, V), dt), eye], axis=-1)
  o, s = kda(q, k, v_ext, g, beta, initial_state=s0, output_final_state=True, backend=backend,
             **kwargs)
  return RangeMap(o[..., :V], o[..., V:], s[..., :V], s[..., V:])
