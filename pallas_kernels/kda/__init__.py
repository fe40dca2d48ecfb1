"""Kimi Delta Attention: `kda(...)` is the public op (see ops.py); `kda_step` decodes one token;
`naive_kda` / `chunk_kda` are the pure-jnp references (see reference.py)."""

from pallas_kernels.kda.ops import kda, kda_step
from pallas_kernels.kda.reference import chunk_kda, naive_kda

__all__ = ["kda", "kda_step", "naive_kda", "chunk_kda"]
