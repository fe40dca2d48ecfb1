"""Kernels for k3jax, each with the plain definition it is tested against. Imports nothing of the
project's other packages (k3jax, convert, configs, sharding).

One pattern, one folder per op:

  <op>/reference.py   the definition in plain jnp, written to be read, not tuned; every
                      implementation is tested against it (in float64 where it runs there)
  <op>/<backend>.py   one file per implementation or backend (a Pallas kernel, a tuned jnp
                      form, an XLA op), taking the reference's arguments plus its own knobs
                      (`interpret` for a Pallas kernel, a tile size, ...)
  <op>/ops.py         the public, differentiable function and its dispatch: an explicit table
                      from backend name to implementation, and the platform's default
  <op>/__init__.py    re-exports the public names

An op with a single implementation keeps it in ops.py (flash_attention) until a second one
arrives.

Options that travel together are one frozen dataclass (static, hashable: usable as a jit static
argument), like jax's flash attention BlockSizes: `kda.RawInputs`. Arrays never go in a bundle;
they stay arguments, so JAX differentiates and shards them as usual.

  kda/              Kimi Delta Attention: naive / chunked references, xla_cpu, Pallas TPU,
                    Triton and Mosaic GPU kernels
  grouped_matmul/   the routed experts' grouped matmul: ragged_dot, tiled, megablox (JAX's
                    Pallas TPU kernels under our custom_vjp)
  flash_attention/  blockwise causal attention with its own backward (jnp, in ops.py)
  mxfp4/            the MXFP4 format (numpy on the host, jnp on the device)
  vma.py            typing helper for kernels traced inside shard_map
"""
