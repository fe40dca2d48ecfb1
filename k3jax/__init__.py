"""k3jax: Kimi K3 in JAX (Flax NNX), with Pallas KDA kernels, Per-Head Muon and converters."""

from k3jax.config import ModelConfig
from k3jax.errors import ConfigError
from k3jax.hf_config import from_hf_config

__all__ = ["ConfigError", "ModelConfig", "from_hf_config"]
__version__ = "0.1.0"
