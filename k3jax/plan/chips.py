"""The devices of a TPU topology `k3jax plan` compiles for; the chip table itself (HBM, peak
FLOP/s, ICI) is k3jax/chips.py, which `k3jax train` reads for MFU too (re-exported here)."""

from __future__ import annotations

import os

from jax.experimental import topologies

from k3jax.chips import ALIASES, CHIPS, GIB, Chip, chip_of  # noqa: F401 - re-exported
from k3jax.errors import UserError


def topology_devices(topology: str) -> list:
  """Devices of a TPU topology description (compile-only; libtpu, no TPU needed)."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    import libtpu  # noqa: F401, PLC0415 - a test extra, not a core dependency
  except ImportError:
    raise UserError("--topology needs libtpu (pip install libtpu) to compile for TPU") from None
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  except Exception as e:  # noqa: BLE001 - libtpu raises XlaRuntimeError / ValueError
    raise UserError(f"--topology {topology!r}: {str(e).splitlines()[0]}; known chips: "
                    f"{', '.join(CHIPS)} (as CHIP:TOPOLOGY, e.g. v5e:2x2, v5p:8x8x16, "
                    "tpu7x:8x8x8)") from None
  return list(topo.devices)
