"""MXFP4 (OCP microscaling FP4): the format (`format.py`, host numpy and device jnp)."""

from pallas_kernels.mxfp4.format import (E2M1, GROUP, dequantize, dequantize_np, quantize,
                                         quantize_np, round_mxfp4)

__all__ = ["E2M1", "GROUP", "dequantize", "dequantize_np", "quantize", "quantize_np",
           "round_mxfp4"]
