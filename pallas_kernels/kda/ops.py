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
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import jax

# public here too (ops.GATES, ops.prepare_inputs), as before the bundle
from pallas_kernels.kda.reference import GATES, RawInputs, prepare_inputs  # noqa: F401 - re-exported


class _Backend(NamedTuple):
  """Where a backend's functions live, as "module:function" under pallas_kernels.kda: imported on
  first use, since a Pallas module does not import on every JAX (Pallas Triton is deprecated,
  Mosaic GPU needs a recent one)."""
  kda: str       # the op: (q, k, v, g, beta, *, scale, initial_state, ..., raw) -> (o, state)
  kda_step: str  # one decode token on prepared inputs: (q, k, v, g, beta, state, *, scale)
  pallas: bool   # both also take `interpret`


_REGISTRY = {
    # the jnp backends decode with the reference step: one token has no chunk to form
    "naive": _Backend("reference:naive_kda", "reference:kda_step", pallas=False),
    "chunked": _Backend("reference:chunk_kda", "reference:kda_step", pallas=False),
    "xla_cpu": _Backend("xla_cpu:kda_xla_cpu", "reference:kda_step", pallas=False),
    "pallas_tpu": _Backend("tpu:kda_tpu", "tpu:kda_step_tpu", pallas=True),
    "pallas_gpu": _Backend("gpu:kda_gpu", "gpu:kda_step_gpu", pallas=True),
    "pallas_mosaic_gpu": _Backend("mosaic_gpu:kda_mosaic_gpu", "mosaic_gpu:kda_step_mosaic_gpu",
                                  pallas=True),
}
BACKENDS = tuple(_REGISTRY)


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
