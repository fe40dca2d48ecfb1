"""Test-suite set-up shared by every test file.

8 fake CPU devices so sharding tests can build real meshes (SPEC §6); a single-device test
simply uses device 0. float64 tests enter `jax.enable_x64(True)` themselves (fixture `x64`)
so that float32 code paths stay float32 everywhere else.
"""

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
