"""Fixtures shared by the k3jax tests."""

import json

import pytest


@pytest.fixture(scope="session")
def config_file(tmp_path_factory):
  """(path, cfg): a K3-shaped model (K3's widths and vocabulary, 2 layers: one KDA, one MLA;
  32 experts) as a k3jax config file, the model `k3jax plan`'s tests compile for TPU."""
  from configs import k3
  cfg = k3.reduced(num_layers=2, num_experts=32)
  path = tmp_path_factory.mktemp("plan") / "k3_reduced.json"
  path.write_text(json.dumps({"format": "k3jax", "config": cfg.to_dict()}))
  return str(path), cfg
