"""NVIDIA GPUs' bf16 dense peak and HBM bandwidth, from NVIDIA's data sheets, for MFU.

The data sheets print the tensor-core figure with 2:4 sparsity; the dense figure is half of it.
jax's `device_kind` names the card ("NVIDIA H100 80GB HBM3" is the SXM part). A card not
listed gets None: the MFU against the measured matmul peak is still reported.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuChip:
  name: str
  peak_bf16_flops: float   # dense FLOP/s
  hbm_bandwidth: float     # bytes/s


# (substring of device_kind, chip), the first match wins: the longer names first
GPU_CHIPS: tuple[tuple[str, GpuChip], ...] = (
    ("H100 PCIe", GpuChip("H100 PCIe", 756e12, 2.0e12)),
    ("H100 NVL", GpuChip("H100 NVL", 835e12, 3.9e12)),
    ("H100", GpuChip("H100 SXM", 989e12, 3.35e12)),
    ("H200 NVL", GpuChip("H200 NVL", 835e12, 4.8e12)),
    ("H200", GpuChip("H200 SXM", 989e12, 4.8e12)),  # the H100 SXM's compute, more and faster HBM
)


def gpu_chip(device_kind: str) -> GpuChip | None:
  """The chip named by jax's `device_kind`, or None if it is not in the table."""
  return next((chip for key, chip in GPU_CHIPS if key in device_kind), None)
