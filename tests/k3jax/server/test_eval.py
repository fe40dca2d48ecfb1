"""`k3jax eval`: lm-evaluation-harness through the server it starts, on two tiny local tasks
(tests/k3jax/server/tasks: multiple choice scored by log-likelihood, and a generate_until task
with a numeric answer; no hub downloads), on the 2-layer byte-level float64 model."""

import json
import os

import jax
import numpy as np
import pytest

from convert.load import load_any
from k3jax import cli
from k3jax.execution import NUMERICS
from k3jax.folders import model_folder
from tests.k3jax.engine.helpers import truth
from tests.k3jax.server import helpers

TASKS = os.path.join(os.path.dirname(__file__), "tasks")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
  """(model folder, output folder, the command's stdout) of one `k3jax eval` run."""
  base = tmp_path_factory.mktemp("eval")
  run = helpers.byte_run(str(base / "run"))
  out = str(base / "out")
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  tasks = ",".join(os.path.join(TASKS, f) for f in ("tiny_mc.yaml", "tiny_gen.yaml"))
  code = cli.main(["eval", run, "--tasks", tasks, "--out", out, "--log-samples",
                   "--dtype", "float64", "--compile-cache", "none", "--max-model-len", "128",
                   "--max-num-seqs", "4"])
  assert code == 0
  return run, out


def _samples(out, task):
  with open(os.path.join(out, f"samples_{task}.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_results_and_summary(evaluated):
  _, out = evaluated
  with open(os.path.join(out, "results.json")) as f:
    results = json.load(f)["results"]
  assert set(results) == {"k3jax_tiny_mc", "k3jax_tiny_gen"}
  assert results["k3jax_tiny_mc"]["sample_len"] == 3 and "acc,none" in results["k3jax_tiny_mc"]
  assert "exact_match,number" in results["k3jax_tiny_gen"]
  gen = _samples(out, "k3jax_tiny_gen")
  assert len(gen) == 2 and all(isinstance(s["resps"][0][0], str) for s in gen)


def test_loglikelihoods_equal_the_full_forward(evaluated):
  run, out = evaluated
  with jax.enable_x64(True):
    model, _ = load_any(model_folder(run).weights, NUMERICS["float64"])
    for sample in _samples(out, "k3jax_tiny_mc"):
      for (context, continuation), [[got, _]] in zip(sample["arguments"], sample["resps"]):
        ids = list((context + continuation).encode())  # the byte tokenizer
        lp = truth(model, ids)
        start = len(context.encode())
        want = sum(lp[k - 1, ids[k]] for k in range(start, len(ids)))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
