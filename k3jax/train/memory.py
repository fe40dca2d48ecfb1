"""`python -m k3jax.train.memory`: kept working for existing scripts; the memory table of full
vs LoRA fine-tuning now lives in k3jax/plan/memory.py (`python -m k3jax.plan.memory`)."""

import runpy

if __name__ == "__main__":
  runpy.run_module("k3jax.plan.memory", run_name="__main__", alter_sys=True)
