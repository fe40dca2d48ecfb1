"""Flax NNX modules of the K3 family, one concern per file (docs/model.md)."""
