"""Flax NNX modules of the K3 family, one concern per file (docs/model.md).

Two inputs, one convention. `ModelConfig` (k3jax/config.py) says what the model is, the
architecture a checkpoint's config holds; `Execution` (k3jax/execution.py) says how this run
computes it: dtypes, matmul precision, kernel backends, expert dispatch and capacity, remat,
attention, loss chunking, layer scan. Every module is built as `Module(cfg, ex, ..., *, rngs)`
and keeps both (`self.cfg`, `self.ex`); every function that reads an execution choice takes
`ex` right after `cfg` (`f(cfg, ex, ...)`), or `ex` alone where it reads nothing of the
architecture (`Projection(ex, ...)`, `RMSNorm(ex, ...)`). Only the whole model defaults it,
`K3Model(cfg, ex=Execution(), *, rngs)` (the reference numbers: float32, plain kernels);
what runs a built model (decode, the train loss) reads `model.ex`.
"""
