"""device_check.py's sections on the device and its operations: the device itself (versions,
HBM bandwidth, bf16 matmul peak) and the routed experts' grouped matmul. They need jax and
pallas_kernels only (not flax), so they run wherever JAX does.

Each section takes (rec, size, dry) as in _device_kda.py.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._gpu_chips import gpu_chip
from benchmarks._timing import median_seconds
from benchmarks.train import timed
from k3jax.train.flops import measure_matmul_peak
from pallas_kernels.grouped_matmul import grouped_matmul as gmm
from pallas_kernels.mxfp4 import format as mxfp4_format
from pallas_kernels.mxfp4.ops import grouped_matmul_mxfp4

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "numpy", "ml_dtypes", "torch", "triton",
            "fla-core")


def versions() -> dict[str, str | None]:
  def version(name):
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return None
  return {"python": platform.python_version(), "jax_path": jax.__file__,
          **{name: version(name) for name in PACKAGES}}


def this_chip() -> dict | None:
  chip = gpu_chip(jax.devices()[0].device_kind)
  return dataclasses.asdict(chip) if chip else None


def copy_bandwidth(mib: int, reps: int) -> float:
  """Bytes/s of an elementwise pass over a `mib` MiB float32 buffer (read once, written once)."""
  x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
  f = jax.jit(lambda x: x * 2.0)
  return 2 * x.nbytes / median_seconds(lambda: jax.block_until_ready(f(x)), reps)


def device(rec, size, dry) -> None:
  d = jax.devices()[0]
  rec.put("platform", d.platform)
  rec.put("device_kind", d.device_kind)
  rec.put("compute_capability", getattr(d, "compute_capability", None))
  rec.put("versions", versions())
  rec.put("chip", this_chip())
  with rec.part("hbm_bandwidth"):
    rec.put("hbm_bandwidth", copy_bandwidth(size.copy_mib, size.reps))
  with rec.part("matmul_peak"):
    rec.put("matmul_peak", measure_matmul_peak(jnp.bfloat16, n=size.matmul_n))


def grouped_matmul(rec, size, dry) -> None:
  """Expert-sorted rows of a balanced random routing: the bf16 grouped matmul (ragged_dot, the
  GPU default, and tiled) and the packed-MXFP4 one (gradient to x only: the codes are frozen)
  against one dense [m, h] @ [h, f] matmul of the same FLOPs; forward and forward+backward."""
  m, h, f, E = size.gmm
  rec.put("shape", {"m": m, "h": h, "f": f, "E": E, "dtype": "bfloat16"})
  groups = jnp.asarray(np.random.default_rng(0).multinomial(m, np.ones(E) / E), jnp.int32)
  kx, kw = jax.random.split(jax.random.key(0))  # made on the device: K3's sizes are GBs
  x = jax.random.normal(kx, (m, h), jnp.bfloat16)
  w = (jax.random.normal(kw, (E, h, f), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
  codes, scales = jax.jit(mxfp4_format.quantize)(w.astype(jnp.float32))
  square = lambda y: jnp.sum(y.astype(jnp.float32) ** 2)
  runs = {  # name: (product, weights, argnums of the fwd+bwd gradient)
      "dense": (lambda x, w: x @ w, w[0], (0, 1)),
      "ragged_dot": (lambda x, w: gmm(x, w, groups, impl="ragged_dot"), w, (0, 1)),
      "tiled": (lambda x, w: gmm(x, w, groups, impl="tiled"), w, (0, 1)),
      "dense_dx": (lambda x, w: x @ w, w[0], (0,)),
      "mxfp4_tiled": (lambda x, cs: grouped_matmul_mxfp4(x, *cs, groups), (codes, scales), (0,))}
  flops = 2.0 * m * h * f
  for name, (product, weights, argnums) in runs.items():
    loss = lambda x, w, product=product: square(product(x, w))
    modes = {"fwd": product, "fwd_bwd": jax.grad(loss, argnums=argnums)}
    for mode, fn in modes.items():
      if name == "dense_dx" and mode == "fwd":
        continue  # dense's forward: the same program
      with rec.part(f"results/{name}/{mode}"):
        compile_s, seconds = timed(fn, x, weights, iters=size.reps)
        work = flops * (1 + len(argnums)) if mode == "fwd_bwd" else flops
        rec.put(f"results/{name}/{mode}", {"seconds": seconds, "compile_s": compile_s,
                                           "tflops_per_s": work / seconds / 1e12})
  for name, base in (("ragged_dot", "dense"), ("tiled", "dense"), ("mxfp4_tiled", "dense_dx")):
    for mode in ("fwd", "fwd_bwd"):
      r = rec.data.get("results", {})
      mine = r.get(name, {}).get(mode, {}).get("seconds")
      theirs = r.get(base if mode == "fwd_bwd" else "dense", {}).get(mode, {}).get("seconds")
      if mine and theirs:
        rec.put(f"results/{name}/{mode}/over_dense", mine / theirs)
