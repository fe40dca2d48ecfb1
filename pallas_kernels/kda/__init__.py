"""Kimi Delta Attention: `kda(...)` is the public op (ops.py); `kda_step` decodes one token;
`naive_kda` / `chunk_kda` are the plain-jnp references (reference.py) every backend is checked
against; `kda_xla_cpu` is the fast jnp backend (xla_cpu.py)."""

from pallas_kernels.kda.ops import kda, kda_step
from pallas_kernels.kda.reference import chunk_kda, naive_kda
from pallas_kernels.kda.xla_cpu import kda_xla_cpu

__all__ = ["kda", "kda_step", "naive_kda", "chunk_kda", "kda_xla_cpu"]
