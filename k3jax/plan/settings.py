"""The settings search of `k3jax plan --mode train|lora` (docs/plan.md#choosing-the-settings):
the step knobs a request leaves unset (grad accumulation, remat, MLA attention, loss chunk,
the experts' capacity) are chosen, on every candidate mesh, by hand count
(k3jax/plan/analytic.py, a fraction of a second each), and the best few are compiled.

  1. per mesh and combination of remat, attention, loss chunk and capacity, the fewest
     micro-batches whose hand-counted peak is at most `MARGIN` of the HBM (the hand count
     runs below the compiler's peak by the measured ratios that set it: docs/plan.md);
  2. ranked by the estimated step time: the roofline of the work (full remat adds a forward)
     plus the hand-counted communication, not overlapped (every micro-batch gathers the
     weights again), dropless settings before any with a capacity factor (which drops
     tokens), equal estimates by the smallest peak (flash MLA and loss chunks cost no
     counted work);
  3. compiled in that order until one fits (the compiler may refuse what the hand count
     passed), or the first `max_compiles` when the request asks for several.

Explicit flags fix their knob. The explanation goes to stderr; the chosen plan carries the
`k3jax train` flags to run it (`train_args`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable

from k3jax.errors import UserError
from k3jax.execution import Attention, Remat
from k3jax.plan.request import Mode, PlanRequest
from k3jax.plan.search import step_time
from sharding.mesh import MeshError, format_sizes, parse_mesh_spec

# the hand-counted peak a candidate may reach, of the HBM, from the compiled / hand-counted
# ratios measured on the full K3 (docs/plan.md#choosing-the-settings)
MARGIN = {Mode.TRAIN: 0.80, Mode.LORA: 0.75}
LOSS_CHUNK = 2048    # positions per loss chunk when chunking is chosen
CAPACITY = 1.25      # the experts' capacity factor when a bound is chosen (0: dropless)
RETRIES = 3          # compiles until one fits, when --max-compiles is not given
# what `k3jax train` runs with no flag
DEFAULTS = {"grad_accum": 1, "remat": Remat.NONE, "attention": Attention.DENSE,
            "loss_chunk": 0, "capacity_factor": 0.0}
KNOBS = tuple(DEFAULTS)
FLAG = {"grad_accum": "--grad-accum", "remat": "--remat", "attention": "--attention",
        "loss_chunk": "--loss-chunk", "capacity_factor": "--capacity-factor"}


def free_knobs(request: PlanRequest) -> tuple[str, ...]:
  """The knobs the request leaves to the search (None)."""
  return tuple(k for k in KNOBS if getattr(request, k) is None)


def with_defaults(request: PlanRequest) -> PlanRequest:
  """The request with every unset knob at `k3jax train`'s default (no search)."""
  return request.replace(**{k: DEFAULTS[k] for k in free_knobs(request)})


def batch_rows(sizes: dict) -> int:
  return math.prod(sizes.get(a, 1) for a in ("data", "fsdp", "expert"))


def choices(request: PlanRequest, cfg, sizes: dict) -> dict[str, tuple]:
  """Each knob's values to try on a mesh of `sizes` (a fixed knob: its own value). Grad
  accumulation: the divisors of the batch whose micro-batch the mesh's batch axes divide,
  fewest first."""
  rows = batch_rows(sizes)
  free = {
      "grad_accum": tuple(a for a in range(1, request.batch + 1)
                          if request.batch % a == 0 and (request.batch // a) % rows == 0),
      "remat": (Remat.NONE, Remat.SAVE_DOTS, Remat.FULL),  # offload: host memory, not planned
      "attention": (Attention.DENSE, Attention.FLASH) if cfg.mla_layers else (Attention.DENSE,),
      "loss_chunk": (0, LOSS_CHUNK) if request.seq > LOSS_CHUNK else (0,),
      "capacity_factor": (0.0, CAPACITY) if cfg.num_experts else (0.0,),
  }
  return {k: (getattr(request, k),) if getattr(request, k) is not None else free[k]
          for k in KNOBS}


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One mesh and setting, counted by hand."""
  request: PlanRequest  # every knob set
  plan: object          # its analytic TrainPlan
  seconds: float        # the ranking's step time: roofline + communication, not overlapped

  def describe(self) -> str:
    return (f"mesh {self.plan.mesh} " + " ".join(knob_flags(self.request))
            + f": hand-counted peak {self.plan.peak_bytes_per_device / 2**30:.1f} GiB, "
            f"step ~{self.seconds:.2f} s")


def knob_flags(request: PlanRequest) -> list[str]:
  """The knobs as `k3jax train` flags (a default left out)."""
  out = []
  for k in KNOBS:
    v = getattr(request, k)
    if v is None or v == DEFAULTS[k]:
      continue
    out += [FLAG[k], str(v.value if hasattr(v, "value") else v)]
  return out


def train_args(request: PlanRequest, mesh: str) -> list[str]:
  """The `k3jax train` flags that run the planned step (besides --out and the data): the
  plan's compute (bf16 over fp32 masters, the histogram Quantile Balancing it compiles)."""
  args = ["--config", request.config, "--mesh", mesh, "--batch-size", str(request.batch),
          "--seq-len", str(request.seq), *knob_flags(request), "--dtype", "bfloat16",
          "--qb-method", "histogram"]
  if request.mode == Mode.LORA:
    args += ["--lora", str(request.lora_rank), "--base-experts", request.base_experts]
    if request.lora_targets:
      args += ["--lora-targets", *request.lora_targets]
  return args


def search(request: PlanRequest, cfg, meshes: list[dict], plan_one: Callable,
           log: Callable | None = None) -> list:
  """The plans of the best settings on `meshes` (axis sizes): compiled, or for an analytic
  request the best few hand counts, in rank order. `plan_one(request, sizes, analytic)` plans
  one fully set request; its analytic plans carry `step_seconds` with the hand-counted
  communication."""
  log = log or (lambda line: print(f"k3jax plan: {line}", file=sys.stderr, flush=True))
  t0 = time.perf_counter()
  others = [k for k in KNOBS if k != "grad_accum"]
  fitting, closest, tried, skipped = [], None, 0, []
  for sizes in meshes:
    grid = choices(request, cfg, sizes)
    try:
      for combo in itertools.product(*(grid[k] for k in others)):
        for accum in grid["grad_accum"]:  # the fewest micro-batches that fit
          req = request.replace(grad_accum=accum, **dict(zip(others, combo)))
          p = plan_one(req, sizes, True)
          tried += 1
          if closest is None or p.peak_bytes_per_device < closest.plan.peak_bytes_per_device:
            closest = Candidate(req, p, step_time(p))
          if p.peak_bytes_per_device <= MARGIN[request.mode] * p.hbm_bytes_per_device:
            fitting.append(Candidate(req, p, step_time(p)))
            break
    except (MeshError, UserError) as e:  # this mesh cannot take the model or the batch
      skipped.append(f"{format_sizes(sizes)} ({e})")
  for line in skipped:
    log(f"mesh {line}: skipped")
  if closest is None:
    raise UserError(f"no mesh of the topology splits this model and --batch {request.batch}"
                    + (f": {skipped[0]}" if skipped else ""))
  hbm = closest.plan.hbm_bytes_per_device
  log(f"chose {', '.join(FLAG[k] for k in free_knobs(request))} by hand count on "
      f"{len(meshes)} mesh(es): {tried} settings counted in {time.perf_counter() - t0:.0f} s, "
      f"{len(fitting)} with a peak within {MARGIN[request.mode]:.0%} of the "
      f"{hbm / 2**30:.1f} GiB HBM")
  if not fitting:
    raise UserError(_nothing_fits(request, closest, plan_one))
  # a capacity factor drops tokens (it changes what is trained): only when nothing dropless
  # fits; equal estimates (flash MLA and loss chunks cost no counted work): the most headroom
  ranked = sorted(fitting, key=lambda c: (bool(c.request.capacity_factor), c.seconds,
                                          c.plan.peak_bytes_per_device))
  log("ranked dropless first (a capacity factor drops tokens), then by the estimated step "
      "time (the work at peak FLOP/s, full remat adding a forward, plus the hand-counted "
      "communication not overlapped: each micro-batch gathers the weights again):")
  for i, c in enumerate(ranked[:5]):
    log(f"  {i + 1}. {c.describe()}")
  if request.analytic:
    return [c.plan for c in ranked[:request.max_compiles or 3]]
  return _compile(ranked, request.max_compiles, plan_one, log)


def _compile(ranked: list[Candidate], max_compiles: int | None, plan_one: Callable,
             log: Callable) -> list:
  """Compile in rank order: until one fits (at most `RETRIES` tries), or the first
  `max_compiles` when given."""
  plans = []
  limit = max_compiles or RETRIES
  for i, c in enumerate(ranked[:limit]):
    if max_compiles is None and any(p.fits for p in plans):
      break
    log(f"compiling {i + 1}: the full model on mesh {c.plan.mesh}")
    try:
      p = plan_one(c.request, parse_mesh_spec(c.plan.mesh), False)
    except Exception as e:  # noqa: BLE001 - one candidate's failure is reported, the rest go on
      log(f"  {i + 1} could not be built: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
      continue
    plans.append(p)
    verdict = "fits" if p.fits else ("refused by the compiler" if p.compile_oom
                                     else "does not fit")
    log(f"  {i + 1}: compiled peak {p.peak_bytes_per_device / 2**30:.1f} GiB "
        f"({p.peak_bytes_per_device / c.plan.peak_bytes_per_device:.2f}x the hand count), "
        f"{verdict}, {p.compile_seconds:.0f} s")
  if not plans:
    raise UserError("no candidate setting could be compiled; try --analytic")
  return plans



def _nothing_fits(request: PlanRequest, closest: Candidate, plan_one: Callable) -> str:
  """No setting fits: the smallest peak seen, and the largest batch that fits with its
  settings (halving the batch), if any."""
  c = closest
  head = (f"--batch {request.batch} x --seq {request.seq} fits no setting on {c.plan.topology}:"
          f" the smallest hand-counted peak is {c.plan.peak_bytes_per_device / 2**30:.1f} GiB "
          f"per device ({c.describe().split(':')[0]}) against {MARGIN[request.mode]:.0%} of "
          f"{c.plan.hbm_bytes_per_device / 2**30:.1f} GiB")
  sizes = parse_mesh_spec(c.plan.mesh)
  step = c.request.grad_accum * batch_rows(sizes)
  batch = request.batch // 2 // step * step
  while batch >= step:
    p = plan_one(c.request.replace(batch=batch), sizes, True)
    if p.peak_bytes_per_device <= MARGIN[request.mode] * p.hbm_bytes_per_device:
      return head + f"; --batch {batch} fits with those settings"
    batch = batch // 2 // step * step
  return head + (f"; no smaller batch fits either (the state alone is "
                 f"{c.plan.state_bytes_per_device / 2**30:.1f} GiB per device): a larger "
                 "topology" + ("" if request.mode == Mode.LORA else ", or --mode lora"))
