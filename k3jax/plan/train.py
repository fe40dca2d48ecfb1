"""`k3jax plan`: will the train step fit a TPU pod, on which mesh, how fast (docs/plan.md).

The real jitted train step of `k3jax train` (k3jax/train/step.py: forward, loss, backward,
clip, Per-Head Muon, QK-clip, Quantile Balancing) is lowered with abstract inputs
(`jax.ShapeDtypeStruct` carrying the step's own `NamedSharding`s) over the devices of a TPU
topology description (`jax.experimental.topologies.get_topology_desc`; libtpu on a CPU
machine, no TPU needed) and compiled ahead of time. XLA's own figures are then read:

  memory_analysis()  per device: arguments (the sharded train state + batch), temporaries,
                     peak = arguments + outputs - aliased (the donated state) + temporaries,
                     against the chip's HBM: fits or not;
  cost_analysis()    FLOPs and bytes of the per-device program; times the device count next
                     to the model FLOPs of the step (k3jax/train/flops.py), as a ratio;
  step time          an ESTIMATE: max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) per device,
                     a roofline bound that ignores communication and overlap;
  communication      the bytes each device sends per step in the program's collectives, by
                     kind and mesh axis (k3jax/plan/comm.py), and with them the step time
                     bounds [max(compute, communication), compute + communication] (fully
                     overlapped, not at all) and the MFU range they give.

Without `--mesh` a small set of meshes the model can be split on is tried (smallest analytic
footprint first) and the fastest estimate that fits is reported. `--analytic` skips the
compile: argument bytes exactly from the sharded state's shapes, temporaries from a
hand count of what a layer keeps (k3jax/plan/analytic.py), a cross-check, not a replacement.

`--mode lora` plans LoRA fine-tuning instead (`k3jax train --lora RANK`, the same step
function): adapters of rank `--lora` on `--lora-targets`, the base frozen in bf16 with its
routed experts MXFP4-packed (`--base-experts`), AdamW state for the adapters only. Its model
FLOPs are 2/3 of training's (forward 2N and the activation gradient 2N per token; no weight
gradient for a frozen base).

The plan compiles for TPU what TPU runs: bf16 compute over fp32 master weights, the
megablox grouped matmul for the experts (its work counted at the group sizes, not at the
receive buffer: `TrainPlan.skipped_row_flops`), the ragged all-to-all dispatch, and KDA's Pallas
TPU kernels (forward and backward, per shard inside a shard_map: k3jax/model/kda_parallel.py),
whose FLOPs reach the cost analysis through their cost estimates.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.errors import UserError
from k3jax.execution import Attention, Execution, GroupedMatmul, KdaBackend, Remat
from k3jax.model import lora
from k3jax.model.transformer import K3Model
from k3jax.plan import comm, hlo, report, settings
from k3jax.plan.analytic import (
  bytes_per_device,
  dequantised_layer_bytes,
  grouped_rows_run,
  moe_layer_bytes,
  routed_fill,
  train_comm_bytes,
  train_temp,
)
from k3jax.plan.chips import chip_of
from k3jax.plan.compiled import compile_or_refusal, cost_analysis, peak_bytes
from k3jax.plan.request import Mode, PlanRequest
from k3jax.plan.search import search
from k3jax.train import flops as flops_lib
from k3jax.train import step as step_lib
from sharding.mesh import format_sizes, make_mesh
from sharding.placement import check_batch

STEP = step_lib.StepConfig(qb_method="histogram")  # the histogram QB scales to pods


def train_execution(request: PlanRequest) -> Execution:
  """The execution `k3jax train` runs on TPU: bf16 compute, fp32 master weights, megablox,
  KDA's Pallas TPU kernels; the request's remat / attention / loss chunk (0: whole) / the
  experts' capacity factor (None: the defaults, no remat, dense attention, whole logits,
  dropless)."""
  ex = Execution(dtype="bfloat16", param_dtype="float32",
                 moe_grouped_matmul=GroupedMatmul.MEGABLOX, kda_backend=KdaBackend.PALLAS_TPU)
  changes = {}
  if request.remat is not None:
    changes["remat"] = request.remat
  if request.attention is not None:
    changes["attention"] = request.attention
  if request.loss_chunk is not None:
    changes["loss_chunk"] = request.loss_chunk or None
  if request.capacity_factor is not None:
    changes["moe_capacity_factor"] = request.capacity_factor or None  # 0: dropless
  return ex.replace(**changes)


def lora_spec(request: PlanRequest, cfg: ModelConfig) -> lora.AdaptSpec | None:
  """The AdaptSpec a LoRA plan trains (None for a train plan), checked against the model."""
  if request.mode != Mode.LORA:
    return None
  if request.lora_rank <= 0:
    raise UserError(f"--lora RANK must be > 0, got {request.lora_rank}")
  if request.base_experts == "mxfp4" and not cfg.moe_layers:
    raise UserError("--base-experts mxfp4: the model has no routed experts")
  spec = lora.AdaptSpec(rank=request.lora_rank,
                        targets=request.lora_targets or lora.DEFAULT_TARGETS,
                        base_experts=request.base_experts)
  try:
    lora.matching(spec, nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
  except ValueError as e:
    raise UserError(str(e)) from None
  return spec


def abstract_inputs(steps, cfg, ex, batch: int, seq: int, accum: int, spec=None):
  """(state, batch, threshold) as ShapeDtypeStructs in the step's shardings."""
  # what the run initialises (under LoRA: adapters, packed experts, a bf16 frozen base)
  params, bias = jax.eval_shape(lambda: step_lib.init_params(cfg, ex, 0, spec))
  state = step_lib.abstract_state(steps, params, bias)
  rows = batch // accum
  b_sh = steps.batch_sharding
  mk = lambda dt: jax.ShapeDtypeStruct((accum, rows, seq), dt, sharding=b_sh)
  data = {"inputs": mk(jnp.int32), "targets": mk(jnp.int32), "segment_ids": mk(jnp.int32),
          "loss_mask": mk(jnp.bool_)}
  thr = jax.ShapeDtypeStruct((), np.float32, sharding=steps.shardings["step"])
  return state, data, thr


@dataclasses.dataclass
class TrainPlan:
  """One mesh's figures (bytes per device; FLOPs of the whole step unless said)."""
  topology: str
  devices: int
  mesh: str
  batch: int
  seq: int
  grad_accum: int
  remat: str
  loss_chunk: int | None
  attention: str
  mode: str
  analytic: bool
  hbm_bytes_per_device: float
  argument_bytes_per_device: float
  temp_bytes_per_device: float
  output_bytes_per_device: float
  alias_bytes_per_device: float
  peak_bytes_per_device: float
  fits: bool
  compile_seconds: float | None
  compiled_flops: float | None          # cost_analysis, whole step (per device x devices)
  compiled_bytes_accessed: float | None  # cost_analysis, whole step
  model_flops: float
  flops_ratio: float | None
  step_seconds_estimate: float
  state_bytes_per_device: float
  param_count: int
  compile_oom: bool = False  # the compiler refused it (HBM): the peak from its message,
                             # arguments from the shapes, no cost analysis
  remat_flops: float = 0.0      # the forward that remat recomputes (full: all of it)
  optimizer_flops: float = 0.0  # Per-Head Muon's Newton-Schulz over every block (hand count)
  other_flops: float | None = None  # work - model - remat - optimizer - buffer rows:
                                    # padding, masked dense compute, replicated work (waste)
  buffer_row_flops: float | None = None  # the routed experts' grouped matmuls on rows of their
                  # static receive buffer past the expected routed pairs (n k per device), as
                  # run: ragged_dot, at its buffer's size as XLA counts it (capacity c: 1 - 1/c
                  # of it; dropless: the worst case); megablox, only its row tiles' rounding
  skipped_row_flops: float = 0.0  # counted at the buffer's size (the megablox kernels' cost
                  # estimates are static) but never run: its grid stops at the group sizes
  loops: int = 0  # while loops in the compiled program (layer scan, micro-batches, QB's map):
                  # cost_analysis counts each loop body once, so with loops its FLOPs and
                  # bytes are lower bounds, not the step's work
  compiled_matmul_flops: float | None = None  # k3jax/plan/hlo.matmul_flops x devices: the
                  # matmuls (and Pallas kernels' estimates) with loops by their trip counts
  work_flops: float | None = None  # compiled_matmul_flops - skipped_row_flops: the work the
                  # program does; flops_ratio, the split and the estimate use this
  collective_bytes_per_device: dict | None = None  # kind -> bytes each device sends per
                  # step (k3jax/plan/comm.py: loops by trip count; none without a compile)
  collective_bytes_per_axis: dict | None = None  # mesh axes ('fsdp', 'expert,tensor') -> kind
                  # -> bytes per device per step
  step_seconds: list | None = None  # [lower, upper]: compute (step_seconds_estimate, the
                  # roofline) and the collectives' bytes / the device's ICI bandwidth fully
                  # overlapped, or not
  mfu: list | None = None  # [lower, upper]: model FLOPs / (step_seconds x devices x peak),
                  # the upper step time giving the lower MFU
  hand_comm_bytes_per_device: float | None = None  # analytic: the bytes a device sends per
                  # step by hand (analytic.train_comm_bytes), behind its step_seconds and mfu
  train_args: list | None = None  # the `k3jax train` flags that run this step
  lora_rank: int | None = None         # --mode lora: the adapters' rank
  trainable_param_count: int | None = None  # --mode lora: the adapters' parameters

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def report(self) -> str:
    """The plan as text, a few lines."""
    p = self
    lora_on = p.mode == Mode.LORA
    lines = [
        f"plan: {p.topology} ({p.devices} devices), mesh {p.mesh}, batch {p.batch} x "
        f"seq {p.seq} (grad accum {p.grad_accum}), remat {p.remat}, loss chunk "
        f"{p.loss_chunk or 'none'}, attention {p.attention}"
        + (f", LoRA r={p.lora_rank} over a frozen base" if lora_on else "")
        + f": {report.method(p)}",
        f"  parameters      {p.param_count / 1e9:10.3f} B"
        + (f" ({p.trainable_param_count / 1e9:.3f} B trainable)" if lora_on else "")
        + f"; train state per device {report.gib(p.state_bytes_per_device)}",
        f"  arguments       {report.gib(p.argument_bytes_per_device)} per device",
        f"  temporaries     {report.gib(p.temp_bytes_per_device)} per device",
        report.peak(p),
    ]
    if p.compile_oom:
      lines += [report.refused(p, "the peak from its message, no cost analysis"),
                "                  (where it goes: XLA_FLAGS=--xla_dump_to=DIR, then "
                "benchmarks/xla_heap.py DIR)"]
    elif p.compile_seconds is not None:
      lines += [
          f"  compile         {p.compile_seconds:8.1f} s",
          f"  FLOPs           compiled matmuls {p.work_flops:.3e} / model "
          f"{p.model_flops:.3e} = {p.flops_ratio:.3f} (loops by trip count; XLA's "
          f"cost_analysis, each of {p.loops} loop bodies once: {p.compiled_flops:.3e})",
          *([f"                  (counted {p.compiled_matmul_flops:.3e}, less "
             f"{p.skipped_row_flops:.3e} of expert buffer rows past the group sizes that "
             "the megablox kernels' grid never runs)"] if p.skipped_row_flops else []),
          f"    split         model 1.000, remat recompute "
          f"{p.remat_flops / p.model_flops:.3f}, optimizer (Newton-Schulz) "
          f"{p.optimizer_flops / p.model_flops:.3f}, expert buffer rows past the "
          f"routed pairs {p.buffer_row_flops / p.model_flops:.3f}, other (waste) "
          f"{p.other_flops / p.model_flops:.3f} (of the model FLOPs)",
          f"  bytes accessed  {p.compiled_bytes_accessed:.3e} (all devices; cost_analysis: "
          "loop bodies once)"]
    else:
      lines.append(f"  FLOPs           model {p.model_flops:.3e}; by hand, remat recompute "
                   f"{p.remat_flops / p.model_flops:.3f} and optimizer "
                   f"{p.optimizer_flops / p.model_flops:.3f} of that on top")
    lines.append(f"  step time       {p.step_seconds_estimate:.3f} s  {report.ESTIMATE}")
    lines += report.communication(p)
    return "\n".join(lines)


def _shapes_only(ex: Execution) -> Execution:
  """`ex` with the knobs the settings search varies at their defaults (they change no shape)."""
  return ex.replace(remat=Remat.NONE, attention=Attention.DENSE, loss_chunk=None,
                    moe_capacity_factor=None)


def plan_one(request: PlanRequest, cfg, ex, devices, mesh_spec, *, analytic: bool,
             spec=None) -> TrainPlan:
  """The plan of the step on one mesh (a spec string or axis sizes)."""
  batch, seq, accum, topology = request.batch, request.seq, request.grad_accum, request.topology
  mesh = make_mesh(mesh_spec, devices)
  check_batch(batch // accum, mesh)
  # a hand count reads the steps' shapes and shardings only, which remat, attention, the loss
  # chunk and the capacity do not change: one build per mesh for the whole settings search
  steps = step_lib.build(cfg, _shapes_only(ex) if analytic else ex, STEP, mesh, spec)
  state, data, thr = abstract_inputs(steps, cfg, ex, batch, seq, accum, spec)
  chip = chip_of(topology, devices[0].device_kind)
  n = len(devices)
  count = flops_lib.count(cfg, seq)
  lora_on = spec is not None and spec.lora
  # the FLOPs split: full remat recomputes the forward (a third of the training FLOPs),
  # save-attention all of it but MLA's attention; save-dots and offload keep the
  # projections' outputs, recomputing the rest: counted as none. Muon's Newton-Schulz once
  # per step
  remat_flops = {Remat.FULL: count.forward_per_token,
                 Remat.SAVE_ATTENTION: count.forward_per_token - count.mla_attention,
                 }.get(ex.remat, 0.0) * batch * seq
  optimizer_flops = 0.0 if lora_on else flops_lib.newton_schulz_flops(cfg)
  # LoRA: forward 2N + activation gradient 2N per token, no weight gradient for the base
  model_flops = count.train_per_token * batch * seq * (2 / 3 if lora_on else 1)
  state_bytes = sum(bytes_per_device(x) for x in jax.tree.leaves(state))
  batch_bytes = sum(bytes_per_device(x) for x in jax.tree.leaves(data)) + 4
  params_bytes = sum(bytes_per_device(x) for x in jax.tree.leaves(state["params"]))
  largest = max(bytes_per_device(x) for x in jax.tree.leaves(state["params"]))
  n_params = step_lib.count_params(state["params"])
  trainable = step_lib.partition(state["params"], steps.trainable)[0]
  if lora_on:  # the temporaries' gradients are the adapters'; packed experts are dequantised
    # a tile at a time in the grouped matmuls, except under QAT, which rounds each MoE layer's
    # whole W + s A B (bf16, this device's share)
    params_bytes = (sum(bytes_per_device(x) for x in jax.tree.leaves(trainable))
                    + (dequantised_layer_bytes(state["params"]) if spec.qat else 0))
  sizes = dict(mesh.shape)
  rows_dev = (batch // accum) // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
  seq_dev = seq // sizes.get("context", 1)  # a device's positions of each row
  common = dict(topology=topology, devices=n, mesh=format_sizes(sizes), batch=batch, seq=seq,
                grad_accum=accum, remat=ex.remat.value, loss_chunk=ex.loss_chunk,
                attention=ex.attention.value,
                hbm_bytes_per_device=chip.hbm_bytes, model_flops=model_flops,
                state_bytes_per_device=state_bytes, param_count=n_params,
                mode=(Mode.LORA if lora_on else Mode.TRAIN).value,
                lora_rank=spec.rank if lora_on else None,
                trainable_param_count=step_lib.count_params(trainable) if lora_on else None,
                remat_flops=remat_flops, optimizer_flops=optimizer_flops,
                train_args=settings.train_args(request, format_sizes(sizes)))
  if analytic:
    arg = state_bytes + batch_bytes
    temp = train_temp(cfg, ex, rows_dev, seq_dev, sizes["tensor"], state_bytes, params_bytes,
                      moe_layer_bytes(cfg, ex, mesh, batch // accum * seq),
                      accum=accum, largest_per_device=0.0 if lora_on else largest,
                      context_seq=seq if seq_dev < seq else 0)
    peak = arg + temp
    # per device: the model FLOPs share plus remat's recompute (one more forward)
    per_dev = (model_flops + remat_flops) / n
    est = max(per_dev / chip.peak_flops, (state_bytes * 3 + temp) / chip.hbm_bandwidth)
    sent = train_comm_bytes(cfg, ex, mesh, state["params"], trainable, rows_dev, seq_dev,
                            accum)
    bounds = step_bounds(est, sent, chip)
    return TrainPlan(**common, analytic=True, argument_bytes_per_device=arg,
                     temp_bytes_per_device=temp, output_bytes_per_device=state_bytes,
                     alias_bytes_per_device=state_bytes, peak_bytes_per_device=peak,
                     fits=peak <= chip.hbm_bytes, compile_seconds=None, compiled_flops=None,
                     compiled_bytes_accessed=None, flops_ratio=None, step_seconds_estimate=est,
                     hand_comm_bytes_per_device=sent, step_seconds=bounds,
                     mfu=mfu_range(model_flops, bounds, n, chip))

  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = steps.train.jitted.trace(state, data, thr).lower(lowering_platforms=("tpu",))
  compiled = compile_or_refusal(lowered)
  seconds = time.perf_counter() - t0
  if isinstance(compiled, float):
    # the TPU compiler refuses a program that cannot fit and gives only its total (the
    # arguments included)
    arg = state_bytes + batch_bytes
    return TrainPlan(**common, analytic=False, argument_bytes_per_device=arg,
                     temp_bytes_per_device=max(0.0, compiled - arg),
                     output_bytes_per_device=state_bytes,
                     alias_bytes_per_device=state_bytes, peak_bytes_per_device=compiled,
                     fits=False, compile_seconds=seconds, compiled_flops=None,
                     compiled_bytes_accessed=None, flops_ratio=None,
                     step_seconds_estimate=math.nan, compile_oom=True)
  mem = compiled.memory_analysis()
  peak = peak_bytes(mem)
  cost = cost_analysis(compiled)
  dev_flops = float(cost.get("flops", 0.0))
  dev_bytes = float(cost.get("bytes accessed", 0.0))
  text = compiled.as_text()
  # cost_analysis counts each loop body once (the layer scan, the micro-batches): the ratio
  # and its split come from the matmul FLOPs with loops by their trip counts instead
  by_op: dict = {}
  counted = hlo.matmul_flops(text, by_op) * n
  grouped = sum(f for op, f in by_op.items() if hlo.is_grouped_matmul(op)) * n
  tokens = batch // accum * seq
  buffer_rows = grouped * (1.0 - routed_fill(cfg, ex, mesh, tokens))
  skipped = 0.0
  if ex.moe_grouped_matmul == GroupedMatmul.MEGABLOX:  # its grid stops at the group sizes
    skipped = grouped * (1.0 - grouped_rows_run(cfg, ex, mesh, tokens))
  work, buffer_rows = counted - skipped, buffer_rows - skipped
  est = max(work / n / chip.peak_flops, dev_bytes / chip.hbm_bandwidth)
  try:
    sent = comm.traffic(text, sizes)
  except Exception as e:  # noqa: BLE001 - a compile costs minutes: keep its other figures
    print(f"k3jax plan: the collectives of mesh {format_sizes(sizes)} could not be read "
          f"({type(e).__name__}: {e}); no communication figures", file=sys.stderr)
    sent = None
  per_kind = comm.by_kind(sent) if sent is not None else None
  # compute: the roofline above (its HBM term included, so no bound is below the estimate
  # without communication)
  bounds = step_bounds(est, sum(per_kind.values()), chip) if per_kind is not None else None
  return TrainPlan(**common, analytic=False, loops=text.count(" while("),
                   argument_bytes_per_device=mem.argument_size_in_bytes,
                   temp_bytes_per_device=mem.temp_size_in_bytes,
                   output_bytes_per_device=mem.output_size_in_bytes,
                   alias_bytes_per_device=mem.alias_size_in_bytes, peak_bytes_per_device=peak,
                   fits=peak <= chip.hbm_bytes, compile_seconds=seconds,
                   compiled_flops=dev_flops * n, compiled_bytes_accessed=dev_bytes * n,
                   compiled_matmul_flops=counted, work_flops=work, skipped_row_flops=skipped,
                   flops_ratio=work / model_flops if model_flops else None,
                   step_seconds_estimate=est,
                   collective_bytes_per_device=per_kind,
                   collective_bytes_per_axis=comm.by_axis(sent) if sent is not None else None,
                   step_seconds=bounds,
                   mfu=mfu_range(model_flops, bounds, n, chip),
                   buffer_row_flops=buffer_rows,
                   other_flops=work - model_flops - remat_flops - optimizer_flops - buffer_rows)


def step_bounds(compute_s: float, sent_bytes: float, chip) -> list | None:
  """[lower, upper] step seconds: compute and communication (the bytes one device sends over
  all its ICI links at once) fully overlapped, and not overlapped; None when the chip's ICI
  figures are not known."""
  if chip.ici_bandwidth is None:
    return None
  comm_s = sent_bytes / chip.ici_bandwidth
  return [max(compute_s, comm_s), compute_s + comm_s]


def mfu_range(model_flops: float, bounds: list | None, devices: int, chip) -> list | None:
  """[lower, upper] MFU: model FLOPs over the devices' peak for the upper and lower step."""
  if not bounds or not bounds[0]:
    return None
  peak = devices * chip.peak_flops
  return [model_flops / (bounds[1] * peak), model_flops / (bounds[0] * peak)]


def candidate_meshes(cfg, n: int, rows: int, seq: int = 0) -> list[dict]:
  """A small set of (data, fsdp, expert, context, tensor) splits of n devices: experts over as
  many devices as divide E, heads over tensor in {1, 2, 4, 8}, the rest fsdp (weights sharded)
  or data; only splits whose batch axes divide the rows. Sequences longer than 8,192
  positions are also split over a `context` axis leaving each device 4,096 to 32,768 of them
  (whole KDA chunks)."""
  out = []
  heads = math.gcd(cfg.mla_num_heads, cfg.kda_num_heads)
  contexts = [1] + [c for c in (2, 4, 8, 16, 32, 64, 128, 256)
                    if seq > 8192 and seq % (c * 64) == 0 and 4096 <= seq // c <= 32768]
  for tensor in (1, 2, 4, 8):
    if n % tensor or heads % tensor:
      continue
    for context in contexts:
      if (n // tensor) % context:
        continue
      rest = n // tensor // context
      for expert in sorted({math.gcd(rest, cfg.num_experts), 1}, reverse=True):
        for fsdp in (rest // expert, 1):
          data = rest // expert // fsdp
          sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
          if context > 1:
            sizes["context"] = context
          if rows % (data * fsdp * expert) == 0 and sizes not in out:
            out.append(sizes)
  return out


def run(request: PlanRequest, cfg: ModelConfig, devices: list) -> list[TrainPlan]:
  """The train or LoRA plans of `request` (its batch given) for `cfg` on `devices`. Knobs it
  leaves unset are chosen by the settings search (k3jax/plan/settings.py) on its mesh or on
  every candidate mesh; with every knob set, the candidate meshes are ranked by the smallest
  analytic peak."""
  spec = lora_spec(request, cfg)
  plan = lambda req, mesh, analytic: plan_one(req, cfg, train_execution(req), devices, mesh,
                                              analytic=analytic, spec=spec)
  if settings.free_knobs(request):
    if request.mesh:
      meshes = [dict(make_mesh(request.mesh, devices).shape)]
    else:
      meshes = candidate_meshes(cfg, len(devices), request.batch, request.seq)
    return settings.search(request, cfg, meshes, plan)
  if request.batch % request.grad_accum:
    raise UserError(f"--batch {request.batch} is not a multiple of --grad-accum "
                    f"{request.grad_accum}")
  return search(
      request, lambda mesh, analytic: plan(request, mesh, analytic),
      candidate_meshes(cfg, len(devices), request.batch // request.grad_accum, request.seq),
      rank=lambda p: p.peak_bytes_per_device,
      nothing_fits=f"no mesh of {len(devices)} devices splits this model and batch")
