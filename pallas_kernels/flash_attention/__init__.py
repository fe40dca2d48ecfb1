"""Blockwise causal attention with its own backward (MLA's training attention): `ops.py`."""

from pallas_kernels.flash_attention.ops import flash_attention

__all__ = ["flash_attention"]
