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


def communication(plan) -> list[str]:
  """The collectives' bytes per device by kind and the step time / MFU bounds (compiled train
  and LoRA plans; analytic ones: the hand-counted total; none otherwise)."""
  sent = plan.collective_bytes_per_device
  hand = getattr(plan, "hand_comm_bytes_per_device", None)
  if sent is None and hand is not None and plan.step_seconds:  # analytic: counted by hand
    lo, hi = plan.step_seconds
    return [f"  collectives     {hand / GIB:8.3f} GiB sent per device per step (hand count)",
            f"  step bounds     {lo:.3f} - {hi:.3f} s, MFU {plan.mfu[0]:.1%} - "
            f"{plan.mfu[1]:.1%} (ESTIMATE: compute and ICI fully overlapped - not at all)"]
  if sent is None:
    return []
  total = sum(sent.values())
  kinds = ", ".join(f"{k} {v / GIB:.3f}" for k, v in sent.items() if v)
  lines = [f"  collectives     {total / GIB:8.3f} GiB sent per device per step"
           + (f" ({kinds} GiB)" if kinds else "")]
  lines += [f"    over {axis:10s} " + ", ".join(f"{k} {v / GIB:.3f} GiB" for k, v in per.items())
            for axis, per in (plan.collective_bytes_per_axis or {}).items()]
  if plan.step_seconds:
    lo, hi = plan.step_seconds
    lines.append(f"  step bounds     {lo:.3f} - {hi:.3f} s, MFU {plan.mfu[0]:.1%} - "
                 f"{plan.mfu[1]:.1%} (ESTIMATE: compute and ICI fully overlapped - not at all)")
  else:
    lines.append("  step bounds     unknown: no ICI figures for this chip")
  return lines
