"""The mesh search of every plan mode: the requested mesh alone, or candidates counted by hand,
ranked, and the best few compiled; and the plan to report out of several."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from k3jax.errors import UserError
from k3jax.plan.request import PlanRequest
from sharding.mesh import MeshError


def search(request: PlanRequest, plan_one: Callable, candidates: Iterable[dict], rank: Callable,
           nothing_fits: str) -> list:
  """`plan_one(mesh, analytic)` on the request's mesh; without one, analytically on every
  candidate split the mesh floor accepts (a MeshError skips it), sorted by `rank`, then (unless
  the request is analytic) compiled on the first `max_compiles` of them. `nothing_fits`: the
  error when no candidate splits the model."""
  if request.mesh:
    try:
      return [plan_one(request.mesh, request.analytic)]
    except (UserError, MeshError):
      raise
    except Exception as e:
      raise UserError(f"mesh {request.mesh}: the program could not be built: {_first_line(e)}"
                      ) from e
  ranked = []
  for sizes in candidates:  # analytic first: cheap, and orders the compiles
    try:
      ranked.append(plan_one(sizes, True))
    except MeshError:
      continue
  if not ranked:
    raise UserError(nothing_fits)
  ranked.sort(key=rank)
  if request.analytic:
    return ranked
  plans, failed = [], []
  for p in ranked[:request.max_compiles or 3]:
    try:
      plans.append(plan_one(p.mesh, False))
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 - one candidate's failure is reported, the rest go on
      failed.append(f"{p.mesh}: {_first_line(e)}")
      print(f"k3jax plan: candidate mesh {failed[-1]} (skipped)", file=sys.stderr)
  if not plans:
    raise UserError(f"no candidate mesh could be built ({'; '.join(failed)}); try --analytic "
                    "or another --mesh")
  return plans


def _first_line(e: Exception) -> str:
  lines = [line for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def best(plans: list):
  """The fastest estimate that fits (train, LoRA or decode plans; with its communication not
  overlapped where the plan counts it), else the smallest peak; the first of equals. Decode
  plans with --max-fit: the most slots that fit first (then as above)."""
  most = max((getattr(p, "max_fit_batch", None) or 0 for p in plans), default=0)
  if most:
    plans = [p for p in plans if p.max_fit_batch == most]
    if not any(p.fits for p in plans):
      return min(plans, key=step_time)
  fitting = [p for p in plans if p.fits]
  if fitting:
    return min(fitting, key=step_time)
  return min(plans, key=lambda p: p.peak_bytes_per_device)


def step_time(plan) -> float:
  """The step time plans are ranked by: not overlapped where the plan counts communication."""
  bounds = getattr(plan, "step_seconds", None)
  return bounds[1] if bounds else plan.step_seconds_estimate
