"""LoRA fine-tuning end to end on k3_tiny_a (the released layout, MXFP4 experts): adapters on
MLA and per routed expert over MXFP4-packed frozen experts with QAT. The base stays bit for
bit what it was, only adapters hold optimizer state, the loss falls, and `k3jax export
--merge-lora` writes base + scale * A B (float64, then the official dtypes) whose loaded model
computes the trained model's logits (float64)."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

from convert import mxfp4 as np_mx
from convert import orbax_io
from convert.hf_load import load_model
from k3jax.cli import main
from k3jax.model import lora
from k3jax.train import step as step_lib
from k3jax.train.loop import adapt_spec, run, step_config

from .helpers import options

STEPS = 12
TARGETS = ("mla.*", "moe.experts.*")


def conversations(n):
  """Chat turns with fixed phrasing (the chat SFT test's sums), as plain text: k3_tiny_a has
  256 embeddings, so it trains byte-level (a chat template's special tokens would not fit)."""
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(n):
    a, b = (int(x) for x in rng.integers(0, 50, 2))
    rows.append(f"user: What is {a} plus {b}?\nassistant: {a} plus {b} is {a + b}.\n")
  return "".join(rows)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_dir):
  tmp = tmp_path_factory.mktemp("lora")
  data = tmp / "sums.txt"
  data.write_text(conversations(400))
  base = os.path.join(reference_dir, "k3_tiny_a")
  opts = options(tmp / "run", None, init_from=base, data=str(data), steps=STEPS,
                 decay_steps=STEPS, warmup_steps=2, seq_len=64, eval_every=STEPS,
                 save_every=STEPS, plots=False, tensorboard=False, learning_rate=1e-2,
                 lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS, base_experts="mxfp4",
                 experts_qat=True)
  summary = run(opts)
  return opts, summary, base


def saved_arrays(directory):
  return {p: np.asarray(orbax_io.open_array(directory, p).read().result())
          for p in orbax_io.saved_paths(directory)}


def test_lora_run_trains_adapters_only(trained):
  opts, summary, base = trained
  model, cfg = load_model(base, param_dtype="float32")
  cfg_run = cfg.replace(param_dtype="float32", dtype="float32")
  spec = adapt_spec(opts, cfg_run)
  _, params, bias = step_lib.split_model(model)
  start = step_lib.adapt_params(cfg_run, params, bias, spec, opts.seed)
  start_flat = {tuple(str(k.key) for k in p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(start)[0]}
  saved = saved_arrays(os.path.join(summary["out"], "model"))
  adapters = {p for p in start_flat if lora.adapter_paths(p[:-2] + ("kernel",))[0] == p
              or lora_like(p)}
  # every base array (packed expert codes included) is bit-identical after the steps
  for path, value in start_flat.items():
    if lora_like(path):
      continue
    np.testing.assert_array_equal(saved[path], value, err_msg=".".join(path))
  assert any(p[-1] == "w1_packed" for p in start_flat)
  # the adapters moved, and they are all that is trainable
  n_adapter = sum(v.size for p, v in start_flat.items() if lora_like(p))
  assert any(not np.array_equal(saved[p], start_flat[p]) for p in adapters)
  # rank 4 on each MLA projection ([in..., out...] -> 4 * (in + out)) and each routed expert
  mla_kernels = {p: v.shape for p, v in start_flat.items() if p[0] == "mla" and p[-1] == "kernel"}
  expected = 0
  for path, shape in mla_kernels.items():
    n_in = 2 if path[1] == "o_proj" else 1
    expected += shape[0] * 4 * (np.prod(shape[1:1 + n_in]) + np.prod(shape[1 + n_in:]))
  n_moe, n_exp = len(cfg.moe_layers), cfg.num_experts
  expected += 3 * n_moe * n_exp * 4 * (cfg.latent_size + cfg.moe_intermediate_size)
  assert summary["trainable_params"] == n_adapter == expected
  assert summary["total_params"] == sum(v.size for v in start_flat.values())
  # the optimizer holds state for the adapters only: AdamW's two moments, nothing else
  steps = step_lib.build(cfg_run, step_config(opts), spec)
  state = steps.init(start, bias, step_lib.new_rng(0))
  sizes = [x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
  assert sum(sizes) == 2 * n_adapter
  # the loss falls: bytes start near uniform (ln 256 = 5.5 nats); this text's byte
  # frequencies alone are worth > 2 nats of that, a fraction of which 12 steps must find
  assert summary["last_loss"] < summary["first_loss"] - 0.5, summary
  assert summary["eval_loss"] < summary["first_loss"] - 0.5, summary


def lora_like(path):
  return lora_adapter(path)


def lora_adapter(path):
  from convert.lora_export import is_adapter  # noqa: PLC0415
  return is_adapter(path)
