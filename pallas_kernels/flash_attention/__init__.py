"""Blockwise causal attention with its own backward (MLA's training attention): the public
`flash_attention` in ops.py (one implementation, in jnp: no dispatch yet), the dense definition
it is tested against in reference.py, and `latent_attention` (latent.py), the same over MLA's
compressed latents for queries at an offset (the sequence split over devices)."""

from pallas_kernels.flash_attention.latent import latent_attention
from pallas_kernels.flash_attention.ops import flash_attention

__all__ = ["flash_attention", "latent_attention"]
