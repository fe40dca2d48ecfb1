"""The accelerator chips k3jax knows the figures of: what `k3jax plan` prices a program on and
what `k3jax train` measures MFU against (docs/plan.md#the-chip-table).

One `Chip` per device kind, per device (a tpu7x chip shows as 2 devices): HBM bytes, peak
dense bf16 FLOP/s, HBM bytes/s, and the ICI (NVLink) links of a device with the bytes/s one
link carries each way, from the public spec sheets; the step-time estimates and MFU are only
as good as these. A figure not known is None, so that the table grows one sourced figure at
a time.
"""

from __future__ import annotations

import dataclasses

from k3jax.errors import UserError

GIB = 1024**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  """One device's figures."""
  kind: str
  hbm_bytes: float       # bytes
  peak_flops: float      # dense bf16 FLOP/s (no sparsity)
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
    # NVIDIA's datasheets give bf16 tensor-core FLOP/s with sparsity (1979 TFLOPS for the SXM
    # parts, 1513 for H100 PCIe): dense is half. NVLink 4: 18 links of 50 GB/s
    # bidirectional (900 GB/s a GPU), 25 GB/s one way
    Chip(kind="h100", hbm_bytes=80e9, peak_flops=989.5e12, hbm_bandwidth=3.35e12,
         ici_links=18, ici_link_bandwidth=25e9),
    Chip(kind="h100-pcie", hbm_bytes=80e9, peak_flops=756.5e12, hbm_bandwidth=2.0e12),
    Chip(kind="h200", hbm_bytes=141e9, peak_flops=989.5e12, hbm_bandwidth=4.8e12,
         ici_links=18, ici_link_bandwidth=25e9),
)}

# the devices' own kind strings ("TPU v5 lite", "TPU7x", "NVIDIA H100 80GB HBM3") for the
# names above
ALIASES = {"v5 lite": "v5e", "v5": "v5p", "v6 lite": "v6e", "7x": "tpu7x"}


def chip_of(topology: str, device_kind: str) -> Chip:
  """The chip figures for a topology name ('v5p:8x8x16') or the devices' kind string."""
  for key in (topology.split(":")[0].lower(), device_kind.lower().removeprefix("tpu ")):
    key = ALIASES.get(key, key)
    if key in CHIPS:
      return CHIPS[key]
  found = device_chip(device_kind)
  if found is not None:
    return found
  raise UserError(f"no HBM / FLOP/s figures for {device_kind!r} ({topology}); known: "
                  f"{', '.join(sorted([*CHIPS, *ALIASES]))}")


def device_chip(device_kind: str) -> Chip | None:
  """The chip of a device's `device_kind` string (TPU or NVIDIA), or None (a CPU, a chip not
  in the table)."""
  kind = device_kind.lower()
  if kind.startswith("nvidia "):
    if "h200" in kind:
      return CHIPS["h200"]
    if "h100" in kind:
      return CHIPS["h100-pcie" if "pcie" in kind else "h100"]
    return None
  key = kind.removeprefix("tpu ").strip()
  key = ALIASES.get(key, key)
  return CHIPS.get(key)
