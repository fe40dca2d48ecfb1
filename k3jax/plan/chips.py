"""The TPU chips `k3jax plan` prices a program on, and the devices of a topology.

One `Chip` per device kind, per device (a tpu7x chip shows as 2 devices): HBM bytes, peak
bf16 FLOP/s, HBM bytes/s, and the ICI links of a device with the bytes/s one link carries each
way, from the public spec sheets (docs/plan.md#the-chip-table says which figure is published
and which derived); the step-time estimates are only as good as these. A figure not known is
None, so that the table grows one sourced figure at a time.
"""

from __future__ import annotations

import dataclasses
import os

from jax.experimental import topologies

from k3jax.errors import UserError

GIB = 1024**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  """One device's figures."""
  kind: str
  hbm_bytes: float       # bytes
  peak_flops: float      # bf16 FLOP/s
  hbm_bandwidth: float   # bytes/s
  ici_links: int | None = None               # ICI links of one device (a tpu7x chip's 2
                                             # devices share its links: half each)
  ici_link_bandwidth: float | None = None    # bytes/s one link carries each way

  @property
  def ici_bandwidth(self) -> float | None:
    """bytes/s one device can send over all its links at once (None: not known)."""
    if self.ici_links is None or self.ici_link_bandwidth is None:
      return None
    return self.ici_links * self.ici_link_bandwidth


CHIPS: dict[str, Chip] = {c.kind: c for c in (
    Chip(kind="v4", hbm_bytes=32 * GIB, peak_flops=275e12, hbm_bandwidth=1.2e12),
    # ICI: the pages give the bidirectional bandwidth of a chip; per link each way = that /
    # links / 2 (v5e 400 GB/s over 4 ports, v6e 800 over 4, v5p and tpu7x 1200 over the 6
    # links of a 3D torus: their link count is not published)
    Chip(kind="v5e", hbm_bytes=16 * GIB, peak_flops=197e12, hbm_bandwidth=0.82e12,
         ici_links=4, ici_link_bandwidth=50e9),
    Chip(kind="v5p", hbm_bytes=95 * GIB, peak_flops=459e12, hbm_bandwidth=2.76e12,
         ici_links=6, ici_link_bandwidth=100e9),
    Chip(kind="v6e", hbm_bytes=32 * GIB, peak_flops=918e12, hbm_bandwidth=1.64e12,
         ici_links=4, ici_link_bandwidth=100e9),
    Chip(kind="tpu7x", hbm_bytes=96e9, peak_flops=1153e12, hbm_bandwidth=3.69e12,
         ici_links=3, ici_link_bandwidth=100e9),
)}

# the devices' own kind strings ("TPU v5 lite", "TPU7x") for the topology names above
ALIASES = {"v5 lite": "v5e", "v5": "v5p", "v6 lite": "v6e", "7x": "tpu7x"}


def chip_of(topology: str, device_kind: str) -> Chip:
  """The chip figures for a topology name ('v5p:8x8x16') or the devices' kind string."""
  for key in (topology.split(":")[0].lower(), device_kind.lower().removeprefix("tpu ")):
    key = ALIASES.get(key, key)
    if key in CHIPS:
      return CHIPS[key]
  raise UserError(f"no HBM / FLOP/s figures for TPU {device_kind!r} ({topology}); known: "
                  f"{', '.join(sorted([*CHIPS, *ALIASES]))}")


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
