"""The lines every plan's report shares (k3jax/plan/train.py, decode.py)."""

from __future__ import annotations

from k3jax.plan.chips import GIB

ESTIMATE = "(ESTIMATE: roofline of peak FLOP/s and HBM bandwidth, no communication)"


def gib(x) -> str:
  return f"{x / GIB:8.2f} GiB"


def method(plan) -> str:
  return "analytic (no compile)" if plan.analytic else "compiled (XLA memory/cost analysis)"


def peak(plan) -> str:
  return (f"  peak            {gib(plan.peak_bytes_per_device)} of "
          f"{gib(plan.hbm_bytes_per_device)} HBM: {'FITS' if plan.fits else 'does NOT fit'} "
          f"({plan.peak_bytes_per_device / plan.hbm_bytes_per_device:.0%})")


def refused(plan, what: str) -> str:
  return (f"  compile         {plan.compile_seconds:8.1f} s: refused by the TPU compiler "
          f"(HBM); {what}")
