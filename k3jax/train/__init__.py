"""Training and fine-tuning (docs/training.md): `k3jax train`.

data.py (corpus, packing, grain pipeline) -> step.py (jitted train/eval steps: Per-Head Muon,
QK-clip, Quantile Balancing) -> loop.py (the run: set up through k3jax/run, state.py's
TrainState, eval, logging) with checkpoint.py (Orbax), metrics.py (JSONL, TensorBoard,
console), plots.py (PNG), flops.py (MFU); options.py holds RunOptions; the command is
k3jax/commands/train.py.
"""
