"""MXFP4 (OCP microscaling FP4): the format (`format.py`, host numpy and device jnp), and the
grouped matmul over packed experts (`ops.grouped_matmul_mxfp4`: `reference.py` the definition,
`tiled.py` XLA tile by tile, `tpu.py` the Pallas TPU kernel), imported from `ops` (it pulls in
Pallas, which the format's users, the converter among them, do not need)."""

from pallas_kernels.mxfp4.format import (
                                         E2M1,
                                         GROUP,
                                         dequantize,
                                         dequantize_np,
                                         quantize,
                                         quantize_np,
                                         round_mxfp4,
)

__all__ = ["E2M1", "GROUP", "dequantize", "dequantize_np", "quantize", "quantize_np",
           "round_mxfp4"]
