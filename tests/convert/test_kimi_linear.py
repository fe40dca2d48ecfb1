"""A tiny Kimi-Linear model built and saved by transformers (`KimiLinearForCausalLM`, random
weights, a non-zero router bias), converted by k3jax and compared live with transformers.

What transformers 5.24's `save_pretrained` writes is its own dialect of the Kimi-Linear
layout: a flat config with derived fields (layer_types, mlp_layer_types, linear_*), float32
tensors (the model's dtype), the original tensor names (its conversion mapping reverted: q/k/v
convs split, A_log/dt_bias back on self_attn, experts unfused) except that every `mlp.` is
renamed `block_sparse_moe.`, dense layer 0 included, and no index (one model.safetensors).

Tolerances. transformers runs its router, attention softmax and KDA in float32 even inside a
float64 module, so its "float64" logits are float32-accurate only (here ~1e-5 away from its
own float32 run, logits of size ~3): k3jax in float64 must agree to the docs/correctness.md layer
bound 1e-5. A k3jax float32 run carries float32 noise of its own: the docs/correctness.md
whole-model bound, 1e-4, against both of transformers' runs, with the same argmax everywhere.
"""

import json
import os

import numpy as np
import pytest

from k3jax.cli import main
from k3jax.parity import compare, judge, run_model

torch = pytest.importorskip("torch")


def build(folder):
  from transformers import KimiLinearConfig, KimiLinearForCausalLM
  cfg = KimiLinearConfig(
      vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
      q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8,
      num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=8,
      linear_num_heads=2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
      eos_token_id=2, layer_types=["linear_attention"] * 3 + ["full_attention"],
      mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
  cfg._experts_implementation = "eager"  # torch's grouped_mm has no float64 kernel on CPU
  torch.manual_seed(0)
  model = KimiLinearForCausalLM(cfg).eval()
  with torch.no_grad():  # transformers' init leaves many tensors constant: randomise all
    for name, p in model.named_parameters():
      if "A_log" in name:
        p.uniform_(-1, 1)
      elif "dt_bias" in name:
        p.uniform_(-3, 0)
      elif name.endswith("norm.weight"):
        p.uniform_(0.5, 1.5)
      elif p.ndim >= 2:
        p.normal_(0, p.shape[-1] ** -0.5)
      else:
        p.normal_(0, 0.5)
    for name, b in model.named_buffers():
      if "e_score_correction_bias" in name:
        b.uniform_(-0.5, 0.5)
  model.save_pretrained(folder)
  return model


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
  root = tmp_path_factory.mktemp("kimi_linear")
  folder = str(root / "hf")
  model = build(folder)
  ids = torch.randint(3, 64, (2, 21), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    logits32 = model(ids).logits.numpy().astype(np.float64)
    biases = [b for name, b in model.named_buffers() if "e_score_correction_bias" in name]
    saved = [b.clone() for b in biases]
    for b in biases:  # the bias must matter for the check to mean much
      b.zero_()
    unbiased = model(ids).logits.numpy()
    for b, value in zip(biases, saved):
      b.copy_(value)
    logits64 = model.double()(ids).logits.numpy()
  assert np.abs(unbiased - logits32).max() > 0.05
  ref = {"input_ids": ids.numpy().astype(np.int32)}
  np.savez(root / "ref64.npz", logits_fp64=logits64.astype(np.float32), **ref)
  return {"folder": folder, "root": root, "ids": ref["input_ids"], "logits32": logits32,
          "logits64": logits64}


def test_saved_layout_is_the_dialect_we_expect(kimi):
  from safetensors import safe_open
  with safe_open(os.path.join(kimi["folder"], "model.safetensors"), "numpy") as f:
    names = set(f.keys())
  assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names  # dense MLP, renamed
  assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
  assert "model.layers.0.self_attn.q_conv1d.weight" in names


def test_info_counts_the_saved_parameters(kimi, capsys):
  """`k3jax info` on Kimi-Linear's config.json counts what transformers saved (its buffers, the
  router's e_score_correction_bias, aside)."""
  from tests.k3jax.test_info import safetensors_param_count
  assert main(["info", "--config", os.path.join(kimi["folder"], "config.json"), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["total_params"] == safetensors_param_count(kimi["folder"])
  assert out["layers"] == {"kda": 3, "mla": 1, "dense_mlp": 1, "moe": 3}


def test_float64_matches_transformers(kimi):
  ref = {"input_ids": kimi["ids"], "logits_fp64": kimi["logits64"]}
  r = compare(kimi["folder"], ref, "float64")
  assert r["max_abs_logit_diff"] <= 1e-5 and r["argmax_agreement"] == 1.0


def test_float32_matches_transformers(kimi):
  out = run_model(kimi["folder"], kimi["ids"], "float32")
  for truth in ("logits64", "logits32"):
    r = judge(out, {"input_ids": kimi["ids"], "logits": kimi[truth]})
    assert r["max_abs_logit_diff"] <= 1e-4 and r["argmax_agreement"] == 1.0, truth


def test_convert_then_parity_and_export_back(kimi, capsys):
  """Through the CLI: convert, parity (float64) on the checkpoint, export; the exported file
  is transformers' own file byte for byte (names, F32 dtypes, header order, metadata)."""
  ckpt, back = str(kimi["root"] / "ckpt"), str(kimi["root"] / "back")
  assert main(["convert", kimi["folder"], ckpt, "--quiet"]) == 0
  capsys.readouterr()
  rc = main(["parity", ckpt, "--reference", str(kimi["root"] / "ref64.npz"),
             "--dtype", "float64", "--json"])
  r = json.loads(capsys.readouterr().out)
  # the stored reference is transformers' float64-module logits rounded to float32
  assert rc == 0 and r["max_abs_logit_diff"] <= 1e-5
  assert main(["export", ckpt, back, "--quiet"]) == 0
  for f in ("model.safetensors", "config.json"):
    with open(os.path.join(kimi["folder"], f), "rb") as a, open(os.path.join(back, f), "rb") as b:
      assert a.read() == b.read(), f
  assert not os.path.exists(os.path.join(back, "model.safetensors.index.json"))
