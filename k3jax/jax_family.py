"""Is the installed JAX family one release? (jaxlib, the CUDA plugins, libtpu)

JAX ships as several packages that only work together at matching releases: jaxlib loads a
CUDA plugin (`jax-cuda12-plugin` / `-pjrt`, `jax-cuda13-*`) only when its version equals
jaxlib's, and libtpu must be the release jax's own `tpu` extra names (an older libtpu cannot
read the newer Mosaic kernels jax writes). A mismatch does not fail at install time: jaxlib
warns and drops the plugin, libtpu fails later inside a compile. `mismatches()` reads the
installed metadata (nothing is imported or started) so that the test run can stop at its start
and the CLI can say it in one line. docs/install.md says how the tested set moves.
"""

from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

# plugins that jaxlib loads only at its own version (jaxlib/plugin_support.py's rule)
PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
# JAX's CPU-only message when a plugin is dropped; the CLI silences it and says it once itself
PLUGIN_WARNING = r"JAX plugin .* is installed, but it is not compatible"
FIX = "pip install -e '.[test]' -c constraints.txt"


def _installed(name: str) -> str | None:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def _release(version: str) -> tuple[int, ...]:
  """The dotted numeric prefix, as jaxlib compares plugin versions ("0.12.0.1rc1" -> 0,12,0,1)."""
  match = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
  return tuple(int(x) for x in match.group(0).split(".")) if match else ()


def _tpu_pairing(jax_version: str) -> Requirement | None:
  """The libtpu requirement of jax's `tpu` extra, from jax's installed metadata."""
  for line in metadata.requires("jax") or ():
    try:
      req = Requirement(line)
    except InvalidRequirement:
      continue
    if req.name == "libtpu" and req.marker is not None and req.marker.evaluate({"extra": "tpu"}):
      return req
  return None


def mismatches() -> list[str]:
  """Each disagreement within the installed JAX family, as a short phrase; [] when it is one
  release (or JAX is not installed at all)."""
  jax_version, jaxlib_version = _installed("jax"), _installed("jaxlib")
  if jax_version is None or jaxlib_version is None:
    return []
  found = []
  for name in PLUGINS:
    version = _installed(name)
    if version is not None and _release(version) != _release(jaxlib_version):
      found.append(f"{name} {version} with jaxlib {jaxlib_version}")
  libtpu, pairing = _installed("libtpu"), _tpu_pairing(jax_version)
  if libtpu is not None and pairing is not None:
    try:
      paired = pairing.specifier.contains(Version(libtpu), prereleases=True)
    except InvalidVersion:
      paired = False
    if not paired:
      found.append(f"libtpu {libtpu} where jax {jax_version}'s tpu extra pairs "
                   f"libtpu{pairing.specifier}")
  return found


def mismatch_line() -> str | None:
  """One line naming every mismatch and the install that fixes it, or None."""
  found = mismatches()
  if not found:
    return None
  return f"mismatched JAX family: {'; '.join(found)} (install the tested set: {FIX})"
