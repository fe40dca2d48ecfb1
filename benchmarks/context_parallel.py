"""The two choices of context parallelism, measured on fake CPU devices (docs/sharding.md#context-
parallelism):

1. composing the KDA ranges' affine maps over the context axis: `sequential` (n - 1 rounds of
   apply-and-pass) against `tree` (log2 n rounds of map composition), the composition alone
   (forward, and forward + backward) at one K3 device's shapes (heads of 128 x 128);
2. MLA over the split sequence: the latents all-gathered once and attended by each device
   (what the model runs) against a ring that passes one device's latents per step and merges
   the partial softmaxes by log-sum-exp (forward), with the memory each holds.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/context_parallel.py

On virtual devices sharing a CPU the times measure the work and the number of collective
rounds, not an interconnect; the docs say what carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from benchmarks._timing import timed
from k3jax.model import context_parallel
from pallas_kernels.flash_attention import latent
from sharding.mesh import make_mesh


def composition_seconds(n: int, heads: int, k: int, reps: int) -> dict:
  """Median seconds of `entering_states` over context=n, forward and forward + backward."""
  mesh = make_mesh(f"context={n}", jax.devices()[:n])
  keys = jax.random.split(jax.random.key(0), 3)
  m = 0.1 * jax.random.normal(keys[0], (n, heads, k, k))
  c = jax.random.normal(keys[1], (n, heads, k, k))
  s0 = jax.random.normal(keys[2], (heads, k, k))
  spec = P("context")
  out = {}
  for comp in context_parallel.Composition:
    def states(m, c, s0, comp=comp):
      body = lambda m, c, s0: context_parallel.entering_states(m[0], c[0], s0,
                                                               composition=comp)[None]
      return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, P()), out_specs=spec)(
          m, c, s0)
    fwd = jax.jit(states)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(states(*a) ** 2), argnums=(0, 1, 2)))
    out[comp.value] = {"fwd_s": timed(fwd, m, c, s0, reps=reps),
                       "fwd_bwd_s": timed(grad, m, c, s0, reps=reps)}
  return out


def _mla_inputs(n, t_loc, heads):
  ks = jax.random.split(jax.random.key(1), 6)
  t = n * t_loc
  r = lambda k, shape, s=1.0: s * jax.random.normal(k, shape)
  return (r(ks[0], (1, t, heads, 128)), r(ks[1], (1, t, heads, 64)), r(ks[2], (1, t, 512)),
          r(ks[3], (1, t, 64)), r(ks[4], (512, heads, 128), 0.05),
          r(ks[5], (512, heads, 128), 0.05), jnp.ones((1, t), jnp.int32))


def mla_seconds(n: int, t_loc: int, heads: int, block: int, reps: int) -> dict:
  """Median forward seconds of MLA with the sequence split n ways: all-gather vs ring."""
  mesh = make_mesh(f"context={n}", jax.devices()[:n])
  args = _mla_inputs(n, t_loc, heads)
  seq, w = P(None, "context"), P()
  specs = (seq, seq, seq, seq, w, w, seq)
  scale = 192**-0.5
  opts = dict(scale=scale, blocks=(min(block, t_loc), min(block, t_loc)), precision=None)

  def gathered(qn, qr, c, kr, wk, wv, seg):
    g = lambda x: jax.lax.all_gather(x, "context", axis=1, tiled=True)
    start = jax.lax.axis_index("context") * t_loc
    return latent._forward(qn, qr, g(c), g(kr), wk, wv, seg, g(seg), start, **opts)[0]

  def ring(qn, qr, c, kr, wk, wv, seg):
    me = jax.lax.axis_index("context")
    perm = [(j, (j + 1) % n) for j in range(n)]
    o = jnp.zeros(qn.shape[:3] + (128,), jnp.float32)
    lse = jnp.full((1, heads, t_loc), -jnp.inf)
    block_kv = (c, kr, seg)
    for step in range(n):  # at step s this device holds device (me - s)'s latents
      src = (me - step) % n
      o_s, lse_s, _ = latent._forward(qn, qr, *block_kv[:2], wk, wv, seg, block_kv[2],
                                      (me - src) * t_loc, **opts)
      lse_s = jnp.where(jnp.isinf(lse_s), -jnp.inf, lse_s)  # no visible key: no weight
      new = jnp.logaddexp(lse, lse_s)
      safe = jnp.where(jnp.isfinite(new), new, 0.0)
      a = jnp.swapaxes(jnp.exp(lse - safe), 1, 2)[..., None]
      b = jnp.swapaxes(jnp.exp(lse_s - safe), 1, 2)[..., None]
      o, lse = a * o + b * o_s.astype(jnp.float32), new
      if step < n - 1:
        block_kv = tuple(jax.lax.ppermute(x, "context", perm) for x in block_kv)
    return o

  out = {}
  for name, body in (("all_gather", gathered), ("ring", ring)):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=seq,
                               check_vma=False))
    out[name] = {"fwd_s": timed(fn, *args, reps=reps)}
  t = n * t_loc
  out["all_gather"]["latent_bytes_held"] = t * (512 + 64) * 4
  out["ring"]["latent_bytes_held"] = 2 * t_loc * (512 + 64) * 4
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--heads", type=int, default=12, help="KDA heads per device (K3 / tensor=8)")
  p.add_argument("--mla-heads", type=int, default=4, help="MLA heads per device")
  p.add_argument("--t-loc", type=int, default=512, help="MLA positions per device")
  p.add_argument("--block", type=int, default=256)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--json", action="store_true")
  a = p.parse_args(argv)
  result = {"composition": {}, "mla": {}}
  for n in (2, 4, 8):
    result["composition"][n] = composition_seconds(n, a.heads, 128, a.reps)
    if not a.json:
      print(f"compose maps, context={n}: " + ", ".join(
          f"{k} fwd {v['fwd_s'] * 1e3:.2f} ms / fwd+bwd {v['fwd_bwd_s'] * 1e3:.2f} ms"
          for k, v in result["composition"][n].items()), flush=True)
  for n in (4, 8):
    result["mla"][n] = mla_seconds(n, a.t_loc, a.mla_heads, a.block, max(1, a.reps // 2))
    if not a.json:
      print(f"MLA forward, context={n}, {a.t_loc} positions per device: " + ", ".join(
          f"{k} {v['fwd_s']:.3f} s (latents held {v['latent_bytes_held'] / 2**20:.1f} MiB)"
          for k, v in result["mla"][n].items()), flush=True)
  if a.json:
    print(json.dumps(result))


if __name__ == "__main__":
  main()
