"""The tested set (constraints.txt, docs/install.md): it pins every package the issue of
2026-12-06 named, the JAX family at one release, and every install the README and CI make goes
through it; pyproject.toml keeps ranges."""

import os
import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

from tests.test_readme import README, commands, shell_blocks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(REPO, "constraints.txt")
MUST_PIN = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax", "optax",
            "orbax-checkpoint", "tensorstore", "grain", "torch", "transformers", "fla-core",
            "lm-eval", "ruff", "import-linter")


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
  out = {}
  with open(CONSTRAINTS) as f:
    for line in f:
      line = line.split("#")[0].strip()
      if line:
        name, eq, version = line.partition("==")
        assert eq and version, f"constraints.txt: {line!r} is not an exact pin"
        assert _norm(name) not in out, f"constraints.txt pins {name} twice"
        out[_norm(name)] = version
  return out


def test_constraints_pin_the_named_packages_and_one_jax_release():
  pinned = pins()
  assert not [name for name in MUST_PIN if name not in pinned]
  release = pinned["jax"]
  assert {pinned[n] for n in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")} == {release}
  assert "k3jax" not in pinned


def test_installed_set_is_the_tested_set():
  """This environment was installed through constraints.txt (as .ci/run does): every pinned
  package that is installed has its pinned version (triton is uninstalled on purpose)."""
  wrong = {}
  for name, version in pins().items():
    try:
      installed = metadata.version(name)
    except metadata.PackageNotFoundError:
      continue
    if installed != version:
      wrong[name] = (installed, version)
  assert not wrong, f"installed vs constraints.txt: {wrong}"


def test_libtpu_pin_is_what_the_pinned_jax_pairs():
  pinned = pins()
  assert metadata.version("jax") == pinned["jax"]
  tpu = [Requirement(r) for r in metadata.requires("jax") if r.startswith("libtpu")]
  tpu = [r for r in tpu if r.marker is not None and r.marker.evaluate({"extra": "tpu"})]
  assert len(tpu) == 1 and tpu[0].specifier.contains(pinned["libtpu"])


def test_every_install_goes_through_the_constraints():
  with open(README) as f:
    readme = f.read()
  installs = [words for block in shell_blocks(readme) for words in commands(block)
              if words[1:3] == ["install", "-e"]]
  assert len(installs) == 2  # the main job and the tests
  for words in installs:
    assert words[-2:] == ["-c", "constraints.txt"], words
  # inline mentions too (the eval extra)
  for mention in re.findall(r"`(pip install -e [^`]*)`", readme):
    assert mention.endswith("-c constraints.txt"), mention
  with open(os.path.join(REPO, ".ci", "run")) as f:
    ci = [ln for ln in f if "pip install" in ln and "-e" in ln.split()]
  assert len(ci) == 1 and "-c constraints.txt" in ci[0], ci


def test_pyproject_keeps_ranges():
  """A user installing k3jax into their own environment gets ranges, not the tested pins."""
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  reqs = [Requirement(r) for r in project["dependencies"]]
  for extra in project["optional-dependencies"].values():
    reqs += [Requirement(r) for r in extra]
  exact = [str(r) for r in reqs if any(s.operator in ("==", "===") for s in r.specifier)]
  assert not exact
