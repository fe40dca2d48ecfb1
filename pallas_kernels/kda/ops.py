"""The public KDA op (docs/kernels.md#kda-op): one signature, dispatched to a backend.

    o, s = kda(q, k, v, g, beta, scale=..., initial_state=..., output_final_state=...,
               segment_ids=..., backend=None | "naive" | "chunked" | "xla_cpu" | "pallas_tpu"
               | "pallas_gpu" | "pallas_mosaic_gpu", <raw-input options>)

Layouts: q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; beta [B,T,H]; state [B,H,K,V] float32.
The raw-input options (A_log, dt_bias, gate, lower_bound, use_qk_l2norm, l2norm_eps,
use_beta_sigmoid) are defined by reference.prepare_inputs and every backend takes them:

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

import jax

from pallas_kernels.kda import reference, xla_cpu
from pallas_kernels.kda.reference import prepare_inputs  # noqa: F401  (public: ops.prepare_inputs)

BACKENDS = ("naive", "chunked", "xla_cpu", "pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu")
GATES = reference.GATES
_JNP = {"naive": reference.naive_kda, "chunked": reference.chunk_kda,
        "xla_cpu": xla_cpu.kda_xla_cpu}


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


def _pallas(backend: str, op: str):
  """The Pallas kernel `<op>_tpu` / `<op>_gpu` / `<op>_mosaic_gpu` for `backend`, or None if
  its module cannot be imported here."""
  kind = backend.removeprefix("pallas_")
  try:
    module = importlib.import_module(f"pallas_kernels.kda.{kind}")
  except ImportError:  # e.g. a JAX without Pallas Triton (deprecated) or Mosaic GPU
    return None
  return getattr(module, f"{op}_{kind}")


def _resolve(backend: str | None, op: str, K: int | None = None):
  """(backend name, its Pallas kernel or None for the jnp backends). K: the key size, for the
  default's fallbacks (Mosaic GPU handles K <= mosaic_gpu.MAX_K)."""
  if backend is None:
    backend = default_backend()
    if backend == "pallas_mosaic_gpu" and (
        _pallas(backend, op) is None or (K is not None and K > _mosaic_max_k())):
      backend = "pallas_gpu"
    if backend.startswith("pallas") and _pallas(backend, op) is None:
      backend = "xla_cpu"
  if backend not in BACKENDS:
    raise ValueError(f"unknown KDA backend {backend!r}; expected one of {BACKENDS}")
  if not backend.startswith("pallas"):
    return backend, None
  impl = _pallas(backend, op)
  if impl is None:
    raise ImportError(f"KDA backend {backend!r} is not available in this installation")
  return backend, impl


def _mosaic_max_k() -> int:
  return importlib.import_module("pallas_kernels.kda.mosaic_gpu").MAX_K


def kda_step(q, k, v, g, beta, state, *, scale=None, backend=None, interpret=False):
  """One decode token: q, k, g [B,H,K] (prepared: unit q/k, log decay g); v [B,H,V]; beta
  [B,H]; state [B,H,K,V] -> (o [B,H,V] in v's dtype, new state float32).

  The Pallas backends run one fused kernel that updates the state in place (aliased), so a
  decode step reads and writes the state once; the jnp backends (no chunk to form for one
  token) all use reference.kda_step.
  """
  _, impl = _resolve(backend, "kda_step")
  if impl is None:
    return reference.kda_step(q, k, v, g, beta, state, scale=scale)
  return impl(q, k, v, g, beta, state, scale=scale, interpret=interpret)


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
    gate: str | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    l2norm_eps: float = 1e-6,
    use_beta_sigmoid: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention. Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] or None).

  backend=None picks "pallas_tpu" on TPU, "pallas_mosaic_gpu" on sm_90+ GPUs (K <= 128),
  "pallas_gpu" on other GPUs and "xla_cpu" elsewhere, falling back to "xla_cpu" when the Pallas
  module cannot be imported. `interpret` is passed to the
  Pallas kernels (to run them on a CPU).
  """
  backend, impl = _resolve(backend, "kda", K=q.shape[-1])
  reference.check_gate(g, A_log, dt_bias, gate, lower_bound)
  kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            segment_ids=segment_ids, A_log=A_log, dt_bias=dt_bias, gate=gate,
            lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps,
            use_beta_sigmoid=use_beta_sigmoid)
  if impl is None:
    return _JNP[backend](q, k, v, g, beta, **kw)
  return impl(q, k, v, g, beta, interpret=interpret, **kw)
