"""The mesh search of every plan mode: the requested mesh alone, or candidates counted by hand,
ranked, and the best few compiled; and the plan to report out of several."""

from __future__ import annotations

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
    return [plan_one(request.mesh, request.analytic)]
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
  return [plan_one(p.mesh, False) for p in ranked[:request.max_compiles]]


def best(plans: list):
  """The fastest estimate that fits (train, LoRA or decode plans), else the smallest peak."""
  fitting = [p for p in plans if p.fits]
  if fitting:
    return min(fitting, key=lambda p: p.step_seconds_estimate)
  return min(plans, key=lambda p: p.peak_bytes_per_device)
