"""Optimizers of the K3 recipe (docs/training.md): Per-Head Muon + AdamW, and MuonClip's QK-clip."""

from k3jax.optim.groups import (
                                BATCH_AXES,
                                FEATURE_AXES,
                                dimension_numbers,
                                logical_axes_from_state,
                                muon_weight_dimension_numbers,
                                param_labels,
)
from k3jax.optim.muon import (
                                NS_COEFFS,
                                ScaleByPerHeadMuonState,
                                newton_schulz,
                                orthogonalize,
                                per_head_muon,
                                scale_by_per_head_muon,
)
from k3jax.optim.qk_clip import qk_clip, qk_clip_factors

__all__ = [
    "BATCH_AXES", "FEATURE_AXES", "NS_COEFFS", "ScaleByPerHeadMuonState", "dimension_numbers",
    "logical_axes_from_state", "muon_weight_dimension_numbers", "newton_schulz",
    "orthogonalize", "param_labels", "per_head_muon", "qk_clip", "qk_clip_factors",
    "scale_by_per_head_muon",
]
