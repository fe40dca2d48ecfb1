"""`k3jax info`: K3's figures equal SPEC §2.1, computed without allocating the model."""

import json

import pytest

import configs
from k3jax import cli
from k3jax.info import summary


def test_k3_figures_match_spec():
  s = summary(configs.get("k3"))
  assert round(s["total_params"] / 1e12, 3) == 2.779
  assert round(s["routed_expert_params"] / 1e12, 3) == 2.723
  assert s["params_per_routed_expert"] == 3 * 3584 * 3072 == 33_030_144
  assert round(s["active_params"] / 1e9) == 105
  assert s["kda_state_bytes_per_request"] == 69 * 96 * 128 * 128 * 4
  assert s["kda_state_bytes_per_request"] / 2**20 == 414.0
  assert s["kda_state_bytes_per_request"] / 8 / 2**20 == 51.75   # 8-way head sharding
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
  assert "finite=True" in capsys.readouterr().out
