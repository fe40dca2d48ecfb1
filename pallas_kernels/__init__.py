"""Pallas kernels for k3jax. One folder per op: reference.py (pure jnp), one file per backend,
ops.py (the public, differentiable function with backend dispatch)."""
