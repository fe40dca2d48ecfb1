"""Mesh axes, logical-axis rules and (later) expert parallelism for k3jax (SPEC §6)."""
