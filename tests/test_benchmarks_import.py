"""Every benchmark script imports: a name renamed in the project (or in another benchmark that
one imports from) breaks a script only when someone runs it, long after the change."""

import importlib
import pathlib

import pytest

SCRIPTS = sorted(p.stem for p in (pathlib.Path(__file__).parents[1] / "benchmarks").glob("*.py")
                 if not p.stem.startswith("__"))


def test_there_are_scripts():
  assert {"serve", "rl", "decode", "plan_k3"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports(name):
  module = importlib.import_module(f"benchmarks.{name}")
  assert callable(getattr(module, "main", None)) or name.startswith("_"), name
