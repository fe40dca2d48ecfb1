"""The JAX family check (k3jax/jax_family.py): the installed set is one release; a mismatch
(a CUDA plugin or libtpu from another release) stops the test run at its start in one line, and
the CLI says it in one line below the command's own output."""

import os
import subprocess
import sys
from importlib import metadata

import pytest

from k3jax import jax_family

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_installed_family_is_one_release():
  """The environment the suite runs in: every CUDA plugin at jaxlib's version, libtpu the one
  jax's tpu extra names (read here independently of the module under test)."""
  jaxlib = metadata.version("jaxlib")
  for name in jax_family.PLUGINS:
    try:
      assert metadata.version(name) == jaxlib, name
    except metadata.PackageNotFoundError:
      pass
  pairing = [r for r in metadata.requires("jax") if r.startswith("libtpu") and '"tpu"' in r]
  assert len(pairing) == 1, pairing
  wanted = pairing[0].split(";")[0].removeprefix("libtpu==").removesuffix(".*")
  assert metadata.version("libtpu").startswith(wanted + "."), (metadata.version("libtpu"), wanted)
  assert jax_family.mismatches() == []


def _fake_metadata(monkeypatch, versions: dict[str, str], jax_requires: list[str]):
  def version(name):
    if name not in versions:
      raise metadata.PackageNotFoundError(name)
    return versions[name]

  monkeypatch.setattr(jax_family.metadata, "version", version)
  monkeypatch.setattr(jax_family.metadata, "requires",
                      lambda name: jax_requires if name == "jax" else [])


JAX_0121_REQUIRES = ['jaxlib<=0.12.1,>=0.12.1', 'libtpu==0.0.53.*; extra == "tpu"',
                     'jax-cuda12-plugin[with-cuda]<=0.12.1,>=0.12.1; extra == "cuda12"']


def test_the_mismatch_of_2026_12_06(monkeypatch):
  """What a fresh clone got that day: jax 0.12.1 beside the test extra's 0.12.0.1 plugins and
  libtpu 0.0.50.1."""
  _fake_metadata(monkeypatch, {"jax": "0.12.1", "jaxlib": "0.12.1",
                               "jax-cuda12-plugin": "0.12.0.1", "jax-cuda12-pjrt": "0.12.0.1",
                               "libtpu": "0.0.50.1"}, JAX_0121_REQUIRES)
  assert jax_family.mismatches() == [
      "jax-cuda12-plugin 0.12.0.1 with jaxlib 0.12.1",
      "jax-cuda12-pjrt 0.12.0.1 with jaxlib 0.12.1",
      "libtpu 0.0.50.1 where jax 0.12.1's tpu extra pairs libtpu==0.0.53.*"]
  line = jax_family.mismatch_line()
  assert "\n" not in line and line.endswith(f"(install the tested set: {jax_family.FIX})")


def test_matching_sets_pass(monkeypatch):
  _fake_metadata(monkeypatch, {"jax": "0.12.1", "jaxlib": "0.12.1", "jax-cuda13-plugin": "0.12.1",
                               "jax-cuda13-pjrt": "0.12.1", "libtpu": "0.0.53"}, JAX_0121_REQUIRES)
  assert jax_family.mismatches() == []
  _fake_metadata(monkeypatch, {"jax": "0.12.1", "jaxlib": "0.12.1"}, JAX_0121_REQUIRES)
  assert jax_family.mismatch_line() is None  # no compilers installed: nothing to pair
  _fake_metadata(monkeypatch, {}, [])
  assert jax_family.mismatches() == []  # no JAX at all


def test_plugin_release_compared_as_jaxlib_does(monkeypatch):
  """jaxlib compares the dotted numeric prefix: 0.12.0.1 is not 0.12.0, and a suffix is
  ignored."""
  _fake_metadata(monkeypatch, {"jax": "0.12.0.1", "jaxlib": "0.12.0.1",
                               "jax-cuda12-plugin": "0.12.0", "jax-cuda12-pjrt": "0.12.0.1.post1"},
                 [])
  assert jax_family.mismatches() == ["jax-cuda12-plugin 0.12.0 with jaxlib 0.12.0.1"]


@pytest.fixture
def mismatched_env(tmp_path):
  """An environment whose metadata says jax-cuda12-plugin is 0.11.0 (a dist-info ahead of
  site-packages on the path), the rest as installed."""
  info = tmp_path / "jax_cuda12_plugin-0.11.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jax-cuda12-plugin\n"
                                 "Version: 0.11.0\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
  env.pop("PYTEST_XDIST_WORKER", None)
  return env


def test_mismatch_stops_the_test_run_in_one_line(mismatched_env, tmp_path):
  test = tmp_path / "test_never_runs.py"
  test.write_text("def test_never_runs():\n  raise AssertionError('ran')\n")
  # the suite's conftest as a plugin, over a test file of its own
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "tests.conftest", str(test)],
                        cwd=tmp_path, env=mismatched_env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
  assert "ran" not in proc.stdout
  lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "mismatched JAX family" in ln]
  assert len(lines) == 1
  assert "jax-cuda12-plugin 0.11.0 with jaxlib " + metadata.version("jaxlib") in lines[0]


def test_cli_says_it_once_below_its_own_lines(mismatched_env):
  ok = subprocess.run([sys.executable, "-m", "k3jax.cli", "info", "--config", "tiny"],
                      env=mismatched_env, capture_output=True, text=True, timeout=300)
  assert ok.returncode == 0, ok.stderr
  assert "total parameters" in ok.stdout
  assert ok.stderr.splitlines() == [
      f"k3jax info: warning: {_line_in(mismatched_env)}"]
  bad = subprocess.run([sys.executable, "-m", "k3jax.cli", "info", "--config", "no-such-preset"],
                       env=mismatched_env, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2
  lines = bad.stderr.splitlines()
  assert len(lines) == 2 and lines[0].startswith("k3jax info: error: "), lines
  assert lines[1].startswith("k3jax info: warning: mismatched JAX family"), lines


def _line_in(env) -> str:
  return subprocess.run([sys.executable, "-c", "from k3jax import jax_family as f; "
                         "print(f.mismatch_line())"], env=env, capture_output=True, text=True,
                        check=True).stdout.strip()


def test_cli_silences_jaxlibs_own_warning():
  """jaxlib's RuntimeWarning about a dropped plugin never reaches a command's stderr (it landed
  above the one-line errors)."""
  script = ("import sys\nfrom jaxlib import plugin_support\nfrom k3jax import cli\n"
            "cli.main(['info', '--config', 'tiny'])\n"
            "plugin_support.check_plugin_version('jax_cuda12_plugin', '0.12.1', '0.12.0.1')\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr
  assert "not compatible" not in proc.stderr, proc.stderr
