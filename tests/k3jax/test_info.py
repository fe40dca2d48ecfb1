"""`k3jax info`: K3's figures equal docs/model.md#configuration, computed without allocating the
model."""

import json
import math
import os

import configs
from convert.safetensors_io import read_header
from k3jax import cli
from k3jax.info import summary


def test_k3_figures_match_spec():
  s = summary(configs.get("k3"), "bfloat16")
  assert round(s["total_params"] / 1e12, 3) == 2.779
  assert round(s["routed_expert_params"] / 1e12, 3) == 2.723
  assert s["params_per_routed_expert"] == 3 * 3584 * 3072 == 33_030_144
  assert round(s["active_params"] / 1e9) == 105
  assert s["kda_state_bytes_per_request"] == 69 * 96 * 128 * 128 * 4
  assert s["kda_state_bytes_per_request"] / 2**20 == 414.0
  assert s["mla_cache_bytes_per_token"] == 24 * (512 + 64) * 2 == 27_648
  assert s["mla_cache_bytes_per_token_if_all_mla"] == 107_136


def test_kimi_linear_48b_is_48b_a3b():
  s = summary(configs.get("kimi_linear_48b"))
  assert 48e9 < s["total_params"] < 50e9 and 2.9e9 < s["active_params"] < 3.6e9


def test_cli_json(capsys):
  assert cli.main(["info", "--config", "k3", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  for key in ("total_params", "active_params", "kda_state_bytes_per_request",
              "mla_cache_bytes_per_token"):
    assert key in out
  assert out["total_params"] == summary(configs.get("k3"))["total_params"]


def test_cli_bad_config_is_one_line_error(capsys):
  assert cli.main(["info", "--config", "no_such_model"]) == 2
  err = capsys.readouterr().err
  assert "no_such_model" in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_forward_on_tiny(capsys):
  assert cli.main(["info", "--config", "tiny", "--forward"]) == 0
  out = capsys.readouterr().out
  vocab = configs.get("tiny").vocab_size
  assert f"logits (1, 16, {vocab}) float32, finite=True" in out


def safetensors_param_count(folder, kda_heads=None):
  """Parameters in an official-layout folder, read from the safetensors headers alone: MXFP4
  `*_packed` bytes hold two values each, their `*_scale` bytes and the router's
  `e_score_correction_bias` (a buffer, not a parameter) are not counted, and a K3 `A_log`
  ([head_dim], docs/model.md#kda-layer) holds `kda_heads` values and zero padding."""
  total = 0
  for name in sorted(os.listdir(folder)):
    if not name.endswith(".safetensors"):
      continue
    for key, info in read_header(os.path.join(folder, name)).tensors.items():
      if key.endswith(("_scale", "e_score_correction_bias")):
        continue
      if key.endswith("A_log") and kda_heads is not None:
        total += kda_heads
        continue
      total += math.prod(info.shape) * (2 if key.endswith("_packed") else 1)
  return total


def test_released_layout_config_json(reference_dir, capsys):
  """The K3 release's config.json (`text_config`, `linear_attn_config`): the counts equal the
  checkpoint's own tensors and the layer lists of the file."""
  folder = os.path.join(reference_dir, "k3_tiny_a")
  assert cli.main(["info", "--config", os.path.join(folder, "config.json"), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  with open(os.path.join(folder, "config.json")) as f:
    text = json.load(f)["text_config"]
  heads = text["linear_attn_config"]["num_heads"]
  assert out["total_params"] == safetensors_param_count(folder, kda_heads=heads)
  n_mla = len(text["linear_attn_config"]["full_attn_layers"])
  assert out["layers"]["mla"] == n_mla
  assert out["layers"]["kda"] == text["num_hidden_layers"] - n_mla
  assert out["layers"]["dense_mlp"] == text["first_k_dense_replace"]
