"""`k3jax plan --mode rl`: LoRA RL (`k3jax rl --lora`) of one process on a TPU slice, counted
by hand (docs/plan.md#rl-mode).

The process holds the LoRA train state and the serving engine's cache on one mesh: the engine
runs the rollouts on the same arrays the optimizer updates (no weight copy), and its cache (KDA
slots, latent pages, prefix snapshots) stays allocated between steps. So a step needs the most
of two phases:
  train    the LoRA train step's peak (`--mode lora --analytic`, `--batch` rows of `--seq`
           positions, the request's remat / attention / loss chunk; dropless experts, as
           `k3jax rl` runs them) + the cache;
  rollout  the train state + the cache + the engine step's temporaries (`--mode decode
           --serving engine --analytic` with `--batch` slots at `--seq`).
The engine's weights are the train state's (the frozen base and the adapters), not counted
twice. Without `--mesh` every candidate of the LoRA plan's search is counted and the one with the
smallest total that fits is reported first.
"""

from __future__ import annotations

import dataclasses

from k3jax.errors import UserError
from k3jax.plan import decode, report, settings, train
from k3jax.plan.request import Mode, PlanRequest, Serving
from sharding.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class RlPlan:
  """One mesh's LoRA-RL memory per device (bytes)."""
  mesh: str
  devices: int
  slots: int
  seq: int
  grad_accum: int
  lora_rank: int
  snapshots: int
  train_peak_bytes_per_device: float
  train_state_bytes_per_device: float
  kda_slots_bytes_per_device: float
  latent_pages_bytes_per_device: float
  snapshots_bytes_per_device: float
  engine_cache_bytes_per_device: float
  engine_temp_bytes_per_device: float
  train_phase_bytes_per_device: float
  rollout_phase_bytes_per_device: float
  peak_bytes_per_device: float
  hbm_bytes_per_device: float
  fits: bool
  step_seconds_estimate: float  # the LoRA train step's (rollouts not included)
  analytic: bool = True

  def to_json(self) -> dict:
    return {"mode": "rl", **dataclasses.asdict(self)}

  def report(self) -> str:
    g = report.gib
    return "\n".join([
        f"k3jax plan --mode rl: mesh {self.mesh} ({self.devices} devices), {self.slots} rows x "
        f"{self.seq} positions, LoRA rank {self.lora_rank}, grad accumulation "
        f"{self.grad_accum}; {report.method(self)}",
        f"  train phase     {g(self.train_phase_bytes_per_device)} (LoRA step peak "
        f"{g(self.train_peak_bytes_per_device).strip()} + engine cache)",
        f"  rollout phase   {g(self.rollout_phase_bytes_per_device)} (train state "
        f"{g(self.train_state_bytes_per_device).strip()} + engine cache + step temporaries "
        f"{g(self.engine_temp_bytes_per_device).strip()})",
        f"  engine cache    {g(self.engine_cache_bytes_per_device)} (KDA slots "
        f"{g(self.kda_slots_bytes_per_device).strip()}, latent pages "
        f"{g(self.latent_pages_bytes_per_device).strip()}, {self.snapshots} snapshots "
        f"{g(self.snapshots_bytes_per_device).strip()})",
        report.peak(self)])


def run(request: PlanRequest, cfg, devices) -> list[RlPlan]:
  if request.capacity_factor:
    raise UserError(f"--capacity-factor {request.capacity_factor}: RL runs its experts "
                    "dropless (k3jax rl refuses a capacity factor)")
  lora_request = settings.with_defaults(request.replace(mode=Mode.LORA, analytic=True,
                                                        capacity_factor=0.0))
  engine_request = request.replace(mode=Mode.DECODE, analytic=True, serving=Serving.ENGINE)
  ex = decode.serve_execution(engine_request)
  plans = []
  for t in train.run(lora_request, cfg, devices):
    mesh = make_mesh(t.mesh, devices)
    # the rollouts' engine keeps one pool, whole on every device (k3jax/rl/loop.py)
    config, cache, temps, _ = decode.engine_figures(engine_request, cfg, ex, mesh, 0,
                                                    request.batch, shards=1)
    train_phase = t.peak_bytes_per_device + cache.total
    rollout_phase = t.state_bytes_per_device + cache.total + max(temps)
    peak = max(train_phase, rollout_phase)
    plans.append(RlPlan(
        mesh=t.mesh, devices=len(devices), slots=request.batch, seq=request.seq,
        grad_accum=lora_request.grad_accum, lora_rank=request.lora_rank,
        snapshots=config.snapshots, train_peak_bytes_per_device=t.peak_bytes_per_device,
        train_state_bytes_per_device=t.state_bytes_per_device,
        kda_slots_bytes_per_device=cache.kda_slots,
        latent_pages_bytes_per_device=cache.latent_pages,
        snapshots_bytes_per_device=cache.snapshots, engine_cache_bytes_per_device=cache.total,
        engine_temp_bytes_per_device=max(temps), train_phase_bytes_per_device=train_phase,
        rollout_phase_bytes_per_device=rollout_phase, peak_bytes_per_device=peak,
        hbm_bytes_per_device=t.hbm_bytes_per_device, fits=peak <= t.hbm_bytes_per_device,
        step_seconds_estimate=t.step_seconds_estimate))
  return sorted(plans, key=lambda p: (not p.fits, p.peak_bytes_per_device))


__all__ = ["RlPlan", "run"]
