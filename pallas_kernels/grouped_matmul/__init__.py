"""Grouped matmul of expert-sorted rows (the routed experts of a dropless MoE): the public
`grouped_matmul` and its dispatch in ops.py, the definition in reference.py, one file per
implementation (ragged.py, tiled.py, megablox.py)."""

from pallas_kernels.grouped_matmul.ops import (
                                               ALIGN,
                                               IMPLS,
                                               ROWS,
                                               SCOPE,
                                               TILE,
                                               default_impl,
                                               grouped_matmul,
)

__all__ = ["ALIGN", "IMPLS", "ROWS", "SCOPE", "TILE", "default_impl", "grouped_matmul"]
