"""Official safetensors <-> k3jax (Orbax) conversion: the name map, MXFP4, readers, CLI."""
