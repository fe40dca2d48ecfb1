"""Grouped matmul of expert-sorted rows (the routed experts of a dropless MoE): `ops.py`."""

from pallas_kernels.grouped_matmul.ops import (ALIGN, IMPLS, ROWS, SCOPE, TILE, default_impl,
                                               grouped_matmul)

__all__ = ["ALIGN", "IMPLS", "ROWS", "SCOPE", "TILE", "default_impl", "grouped_matmul"]
