"""Grouped matmul on the CPU: `ragged_dot` vs the padded-tile form vs a dense matmul of the
same FLOPs, forward and forward+backward, side by side in one run.

    python benchmarks/grouped_matmul.py                 # m=8192, h=f=256, E=32, float32
    python benchmarks/grouped_matmul.py --m 2048 --E 64 --reps 3

Rows are the expert-sorted (token, expert) pairs of a random top-k routing; "dense" is one
[m, h] x [h, f] matmul, the work a perfectly balanced grouped matmul does. Each number is the
median of --reps jitted, warmed-up runs (block_until_ready).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import timed
from pallas_kernels.grouped_matmul import grouped_matmul


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--m", type=int, default=8192, help="rows (token, expert pairs)")
  p.add_argument("--h", type=int, default=256, help="input width")
  p.add_argument("--f", type=int, default=256, help="output width")
  p.add_argument("--E", type=int, default=32, help="experts")
  p.add_argument("--reps", type=int, default=5)
  a = p.parse_args(argv)
  rng = np.random.default_rng(0)
  sizes = np.bincount(rng.integers(0, a.E, a.m), minlength=a.E).astype(np.int32)
  x = jnp.asarray(rng.standard_normal((a.m, a.h)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((a.E, a.h, a.f)) / a.h**0.5, jnp.float32)
  w_dense = w[0]
  gs = jnp.asarray(sizes)

  def loss(f):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1)))

  ragged = lambda x, w: grouped_matmul(x, w, gs, impl="ragged_dot")
  tiled = lambda x, w: grouped_matmul(x, w, gs, impl="tiled")
  dense = lambda x, w: x @ w
  rows = []
  for name, f, wt in (("dense", dense, w_dense), ("tiled", tiled, w), ("ragged_dot", ragged, w)):
    fwd = timed(jax.jit(f), x, wt, reps=a.reps)
    both = timed(loss(f), x, wt, reps=a.reps)
    rows.append((name, fwd, both))
  base_fwd, base_both = rows[0][1], rows[0][2]
  print(f"m={a.m} h={a.h} f={a.f} E={a.E} float32 on {jax.devices()[0].platform}, "
        f"median of {a.reps}")
  print(f"{'impl':<12}{'fwd ms':>10}{'x dense':>9}{'fwd+bwd ms':>13}{'x dense':>9}")
  for name, fwd, both in rows:
    print(f"{name:<12}{1e3 * fwd:>10.1f}{fwd / base_fwd:>9.1f}{1e3 * both:>13.1f}"
          f"{both / base_both:>9.1f}")


if __name__ == "__main__":
  main()
