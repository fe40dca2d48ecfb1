"""Test-suite set-up shared by every test file.

8 fake CPU devices so sharding tests can build real meshes (docs/sharding.md); a single-device test
simply uses device 0. float64 tests enter `jax.enable_x64(True)` themselves (fixture `x64`)
so that float32 code paths stay float32 everywhere else.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for this test run, shared by the xdist workers (they
# inherit the controller's environment) and the `k3jax train` subprocesses: many tests compile
# the same programs (the micro model's train step, the reference models' forwards), which then
# compile once per run instead of once per test. A fresh folder per run, so no run reuses
# another's programs; XLA keys every entry by program, options and backend.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3jax-tests-xla-")
# transformers and fla pick Triton kernels when fla imports; those fail on a CPU.
sys.modules.setdefault("fla", None)

import jax  # noqa: E402
import pytest  # noqa: E402

REFERENCE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference")


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.fixture(scope="session")
def reference_dir():
  path = os.path.abspath(os.environ.get("K3JAX_REFERENCE_DIR", REFERENCE_DIR))
  if not os.path.isdir(path):
    pytest.fail(f"reference checkpoints not found at {path} (set K3JAX_REFERENCE_DIR)")
  return path


# Longest test files first. pytest-xdist hands out whole files (--dist loadfile) in collection
# order (--no-loadscope-reorder; its default orders files by their number of tests instead,
# which put a one-test, two-minute file last while the other worker sat idle): longest
# processing time first, from the seconds per file a full run measured (durations.json,
# written by a run with K3JAX_RECORD_DURATIONS=tests/durations.json). Files it does not know
# keep their place after the known ones' longer entries.
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
_RECORD = os.environ.get("K3JAX_RECORD_DURATIONS")
_seconds: dict[str, float] = {}


def _file(nodeid: str) -> str:
  return nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
  known = {}
  if os.path.exists(DURATIONS):
    with open(DURATIONS) as f:
      known = json.load(f)
  first = {}
  for item in items:
    first.setdefault(_file(item.nodeid), len(first))
  items.sort(key=lambda item: (-known.get(_file(item.nodeid), 0.0), first[_file(item.nodeid)]))


def pytest_runtest_logreport(report):
  if _RECORD:  # setup, call and teardown; under xdist the controller sees every worker's
    _seconds[_file(report.nodeid)] = _seconds.get(_file(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
  if _RECORD and not hasattr(session.config, "workerinput") and _seconds:
    with open(_RECORD, "w") as f:
      json.dump({k: round(v, 1) for k, v in sorted(_seconds.items(), key=lambda kv: -kv[1])},
                f, indent=1)
      f.write("\n")
