"""Kimi Delta Attention: `kda(...)` is the public op (ops.py, which lists the backends);
`kda_step` decodes one token; `RawInputs` (with `Gate`) is the op's option bundle, how raw
inputs become core inputs; `naive_kda` / `chunk_kda` are the plain-jnp references (reference.py)
every backend is checked against; `kda_xla_cpu` is the fast jnp backend (xla_cpu.py);
`flops_per_token` counts the chunked form's matmul FLOPs."""

from pallas_kernels.kda._chunk_math import flops_per_token
from pallas_kernels.kda.ops import kda, kda_step
from pallas_kernels.kda.reference import Gate, RawInputs, chunk_kda, naive_kda
from pallas_kernels.kda.xla_cpu import kda_xla_cpu

__all__ = ["Gate", "RawInputs", "chunk_kda", "flops_per_token", "kda", "kda_step",
           "kda_xla_cpu", "naive_kda"]
