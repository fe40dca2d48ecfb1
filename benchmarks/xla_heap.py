"""`python benchmarks/xla_heap.py DIR [--module jit_train] [--top 25]`: where a compiled
program's HBM goes, read from an XLA dump (the reader is k3jax/plan/xla_heap.py)."""

from k3jax.plan.xla_heap import main

if __name__ == "__main__":
  main()
