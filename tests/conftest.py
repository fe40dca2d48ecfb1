"""Test-suite set-up shared by every test file.

8 fake CPU devices so sharding tests can build real meshes (docs/sharding.md); a single-device test
simply uses device 0. float64 tests enter `jax.enable_x64(True)` themselves (fixture `x64`)
so that float32 code paths stay float32 everywhere else.
"""

import gc
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests' programs are small and compiled once, so XLA:CPU's LLVM optimisation costs more
# than it saves: at level 0 the tiny models compile (and eager ops dispatch) about twice as
# fast. No fast-math at any level, but the last bits of a float32 result can differ between
# levels (contracted multiply-adds), so programs compared bit-near must be compiled at the same
# level: the subprocesses the tests start inherit the flags. Set XLA_FLAGS with an explicit
# level to override.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent XLA compilation cache for the subprocesses the tests start (they inherit this
# environment): the `k3jax train` runs of test_run.py compile the same train step, so the later
# ones load it instead of compiling it again. A fresh folder per run, so no run reuses another's
# programs. The test processes themselves (the xdist workers) neither read nor write it (below).
_CACHE_MADE_HERE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_MADE_HERE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3jax-tests-xla-")
# transformers and fla pick Triton kernels when fla imports; those fail on a CPU.
sys.modules.setdefault("fla", None)

import jax  # noqa: E402
import pytest  # noqa: E402

from k3jax import jax_family  # noqa: E402

# No persistent cache in the test processes themselves. Writing an entry serializes the
# executable, and XLA:CPU once segfaulted there (a worker out of memory mappings, see
# pytest_runtest_teardown), taking an xdist worker down with it; JAX writes
# every program that took over a second to compile (jax_persistent_cache_min_compile_time_secs),
# so the workers serialized programs all run long, for nothing: nothing but the trainer
# subprocesses read entries back. A crash in a subprocess fails its test with the subprocess's
# output instead of killing a worker, and those subprocesses write a handful of programs.
jax.config.update("jax_enable_compilation_cache", False)

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


class _EndOnWorkerCrash:
  """xdist controller: a worker that crashes (a segfault in XLA, an OOM kill) ends the run.

  xdist reports the test a worker died in as failed, then by default starts a replacement
  worker and gives it the rest of that file, the crashed test included. Under --dist loadfile
  (pytest-xdist 3.8.0) that replacement can wait forever for work the scheduler never sends
  (pytest-dev/pytest-xdist#784, #1327, #1378), and a test that crashes every time re-crashes
  each replacement. `--max-worker-restart=0` (pyproject.toml) stops the replacements; then the
  controller would still wait for the other workers to finish the files already queued on
  them. This ends the session as soon as the crash's failure is recorded, naming the worker
  and the test; the workers still running are terminated by xdist's teardown.
  """

  def __init__(self):
    self.crashed = {}

  def pytest_testnodedown(self, node, error):
    if error is not None:  # None: the worker finished normally
      self.crashed[node.gateway.id] = error

  @pytest.hookimpl(trylast=True)  # after the terminal reporter has recorded the failure
  def pytest_runtest_logreport(self, report):
    node = getattr(report, "node", None)
    # the only report for a worker after its node-down event is xdist's crash report
    if report.failed and node is not None and node.gateway.id in self.crashed:
      pytest.exit(f"worker {node.gateway.id} crashed while running {report.nodeid} "
                  f"({self.crashed[node.gateway.id]}); ending the run",
                  returncode=pytest.ExitCode.TESTS_FAILED)

  def pytest_sessionfinish(self, session):
    # a crash outside any test (while the worker shut down) reports no failure of its own
    if self.crashed and session.exitstatus == pytest.ExitCode.OK:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED

  def pytest_terminal_summary(self, terminalreporter):
    for worker, error in self.crashed.items():
      terminalreporter.write_line(f"worker {worker} crashed: {error}", red=True)


def _max_map_count() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530  # the kernel's default


# Well below the kernel's limit: one test file can add thousands of mappings before the next
# check (test_engine.py, one of the largest, adds about 14000).
_MAPPINGS_LIMIT = _max_map_count() // 3


def _mappings() -> int | None:
  """Memory mappings this process holds now (None where /proc is not there to tell)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return None


@pytest.hookimpl(trylast=True)  # after the runner has torn down the file's module fixtures
def pytest_runtest_teardown(item, nextitem):
  """Drops every compiled program at the end of a test file once the process holds many
  memory mappings.

  Each XLA:CPU executable keeps its JIT-compiled code in memory mappings of its own until it is
  freed, and JAX's caches keep every executable a process ever compiled. An xdist worker runs
  test files for half an hour, compiling thousands of programs: its mappings reach the kernel's
  per-process limit (vm.max_map_count, 65530 by default), an mmap inside XLA's compiler fails,
  and the worker dies with a SIGSEGV or SIGABRT in whatever program it was compiling then.
  Clearing after every file cost more than it saved: what files do share are the small eager
  programs (a model's random init compiles about a hundred of them, seconds per file), so the
  caches are dropped only when the mappings pass a third of the limit.
  """
  if nextitem is None or nextitem.path != item.path:
    n = _mappings()
    if os.environ.get("K3JAX_LOG_MAPS"):
      print(f"\n[maps] {item.path.name}: {n}", file=sys.stderr)
    if n is None or n > _MAPPINGS_LIMIT:
      jax.clear_caches()
      gc.collect()  # the executables held by dropped closures and module fixtures


def pytest_configure(config):
  # A mismatched JAX family (docs/install.md) stops the run here, in one line, before any test:
  # otherwise the kernels' and plans' compiles fail one by one far from the cause (a CUDA
  # plugin jaxlib will not load, a libtpu that cannot read jax's Mosaic kernels).
  line = jax_family.mismatch_line()
  if line is not None and not hasattr(config, "workerinput"):  # the controller (or -n 0)
    pytest.exit(line, returncode=pytest.ExitCode.USAGE_ERROR)
  if (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None)
      and not hasattr(config, "workerinput")):
    config.pluginmanager.register(_EndOnWorkerCrash(), "k3jax-end-on-worker-crash")


def pytest_unconfigure(config):
  if _CACHE_MADE_HERE and not hasattr(config, "workerinput"):  # the process that made it
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_sessionfinish(session):
  if _RECORD and not hasattr(session.config, "workerinput") and _seconds:
    with open(_RECORD, "w") as f:
      json.dump({k: round(v, 1) for k, v in sorted(_seconds.items(), key=lambda kv: -kv[1])},
                f, indent=1)
      f.write("\n")
