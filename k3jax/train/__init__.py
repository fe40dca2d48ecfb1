"""Training and fine-tuning (docs/training.md): `k3jax train`.

inputs.py (what a run trains on: data.py's in-memory documents and packing, chat_data.py,
prepared_data.py's prepared datasets and mixtures over k3jax/corpus) -> step.py (jitted
train/eval steps: Per-Head Muon, QK-clip, Quantile Balancing) -> loop.py (the run: set up
through k3jax/run, state.py's TrainState, eval, logging) with checkpoint.py (Orbax),
metrics.py (JSONL, TensorBoard, console), plots.py (PNG), flops.py (MFU); options.py holds
RunOptions; the command is k3jax/commands/train.py.
"""
