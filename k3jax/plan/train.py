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
                     a roofline bound that ignores communication and overlap.

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
receive buffer: `Plan.skipped_row_flops`), the ragged all-to-all dispatch, and KDA's Pallas
TPU kernels (forward and backward, per shard inside a shard_map: k3jax/model/kda_parallel.py),
whose FLOPs reach the cost analysis through their cost estimates.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

from k3jax.errors import UserError
from k3jax.execution import Execution, GroupedMatmul, KdaBackend, Remat
from k3jax.plan.analytic import _bytes_per_device, _dequantised_layer_bytes, analytic_temp, grouped_rows_run, moe_layer_bytes, routed_fill
from k3jax.plan import hlo

GIB = 1024**3

# Per device (a tpu7x chip shows as 2 devices): HBM bytes, peak bf16 FLOP/s, HBM bytes/s.
# Public spec-sheet figures; the step-time estimate is only as good as these.
CHIPS: dict[str, tuple[float, float, float]] = {
    "v4": (32 * GIB, 275e12, 1.2e12),
    "v5e": (16 * GIB, 197e12, 0.82e12),
    "v5 lite": (16 * GIB, 197e12, 0.82e12),
    "v5p": (95 * GIB, 459e12, 2.76e12),
    "v5": (95 * GIB, 459e12, 2.76e12),
    "v6e": (32 * GIB, 918e12, 1.64e12),
    "v6 lite": (32 * GIB, 918e12, 1.64e12),
    "tpu7x": (96e9, 1153e12, 3.69e12),
    "7x": (96e9, 1153e12, 3.69e12),
}




@dataclasses.dataclass(frozen=True)
class Chip:
  kind: str
  hbm_bytes: float
  peak_flops: float
  hbm_bandwidth: float


def chip_of(topology: str, device_kind: str) -> Chip:
  """The chip figures for a topology name ('v5p:8x8x16') or the devices' kind string."""
  for key in (topology.split(":")[0].lower(), device_kind.lower().removeprefix("tpu ")):
    if key in CHIPS:
      return Chip(key, *CHIPS[key])
  raise UserError(f"no HBM / FLOP/s figures for TPU {device_kind!r} ({topology}); known: "
                  f"{', '.join(sorted(CHIPS))}")


def topology_devices(topology: str):
  """Devices of a TPU topology description (compile-only; libtpu, no TPU needed)."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    import libtpu  # noqa: F401, PLC0415
  except ImportError:
    raise UserError("--topology needs libtpu (pip install libtpu) to compile for TPU") from None
  from jax.experimental import topologies  # noqa: PLC0415
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  except Exception as e:  # noqa: BLE001  (libtpu raises XlaRuntimeError / ValueError)
    raise UserError(f"--topology {topology!r}: {str(e).splitlines()[0]}") from None
  return list(topo.devices)


def plan_config(remat: str | None = None, attention: str | None = None,
                loss_chunk: int | None = None, capacity_factor: float | None = None
                ) -> Execution:
  """The execution `k3jax train` runs on TPU: bf16 compute, fp32 master weights, megablox,
  KDA's Pallas TPU kernels; remat / attention / loss_chunk (0: whole) / the experts' capacity
  factor as given (None: the defaults, no remat, dense attention, whole logits, dropless)."""
  ex = Execution(dtype="bfloat16", param_dtype="float32",
                 moe_grouped_matmul=GroupedMatmul.MEGABLOX, kda_backend=KdaBackend.PALLAS_TPU)
  changes = {}
  if remat is not None:
    changes["remat"] = remat
  if attention is not None:
    changes["attention"] = attention
  if loss_chunk is not None:
    changes["loss_chunk"] = loss_chunk or None
  if capacity_factor is not None:
    changes["moe_capacity_factor"] = capacity_factor
  return ex.replace(**changes)


def abstract_inputs(steps, cfg, ex, batch: int, seq: int, accum: int, spec=None):
  """(state, batch, threshold) as ShapeDtypeStructs in the step's shardings."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from k3jax.train import step as step_lib  # noqa: PLC0415
  # what the run initialises (under LoRA: adapters, packed experts, a bf16 frozen base)
  params, bias = jax.eval_shape(lambda: step_lib.init_params(cfg, ex, 0, spec))
  state = step_lib.abstract_state(steps, params, bias)
  rows = batch // accum
  b_sh = steps.batch_sharding
  mk = lambda dt: jax.ShapeDtypeStruct((accum, rows, seq), dt, sharding=b_sh)  # noqa: E731
  data = {"inputs": mk(jnp.int32), "targets": mk(jnp.int32), "segment_ids": mk(jnp.int32),
          "loss_mask": mk(jnp.bool_)}
  thr = jax.ShapeDtypeStruct((), np.float32, sharding=steps.shardings["step"])
  return state, data, thr


@dataclasses.dataclass
class Plan:
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
  lora_rank: int | None = None         # --mode lora: the adapters' rank
  trainable_param_count: int | None = None  # --mode lora: the adapters' parameters


  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _grouped_matmul_op(op_name: str) -> bool:
  """The routed experts' grouped matmuls in `hlo.matmul_flops`'s by-op names: ragged_dot, or
  megablox's kernels (gmm, tgmm) under grouped_matmul's named scope."""
  from pallas_kernels.grouped_matmul import SCOPE  # noqa: PLC0415
  return "ragged_dot" in op_name or (SCOPE in op_name and "pallas_call" in op_name)


def _mesh_size(mesh) -> dict:
  return dict(mesh.shape)


def plan_one(cfg, ex, sc, devices, topology: str, mesh_spec, *, batch: int, seq: int,
             accum: int, analytic: bool, spec=None) -> Plan:
  import jax  # noqa: PLC0415
  from k3jax.train import flops as flops_lib  # noqa: PLC0415
  from k3jax.train import step as step_lib  # noqa: PLC0415
  from sharding.mesh import format_sizes, make_mesh  # noqa: PLC0415
  from sharding.placement import check_batch  # noqa: PLC0415

  mesh = make_mesh(mesh_spec, devices)
  check_batch(batch // accum, mesh)
  steps = step_lib.build(cfg, ex, sc, mesh, spec)
  state, data, thr = abstract_inputs(steps, cfg, ex, batch, seq, accum, spec)
  chip = chip_of(topology, devices[0].device_kind)
  n = len(devices)
  count = flops_lib.count(cfg, seq)
  lora = spec is not None and spec.lora
  # the FLOPs split: remat recomputes the forward (a third of the training FLOPs; save-dots
  # keeps the matmul outputs, so this is its upper bound); Muon's Newton-Schulz once per step
  remat_flops = count.forward_per_token * batch * seq if ex.remat != Remat.NONE else 0.0
  optimizer_flops = 0.0 if lora else flops_lib.newton_schulz_flops(cfg)
  # LoRA: forward 2N + activation gradient 2N per token, no weight gradient for the base
  model_flops = count.train_per_token * batch * seq * (2 / 3 if lora else 1)
  state_bytes = sum(_bytes_per_device(x) for x in jax.tree.leaves(state))
  batch_bytes = sum(_bytes_per_device(x) for x in jax.tree.leaves(data)) + 4
  params_bytes = sum(_bytes_per_device(x) for x in jax.tree.leaves(state["params"]))
  largest = max(_bytes_per_device(x) for x in jax.tree.leaves(state["params"]))
  n_params = step_lib.count_params(state["params"])
  trainable = step_lib.partition(state["params"], steps.trainable)[0]
  if lora:  # the temporaries' gradients are the adapters'; packed experts are dequantised a
    # tile at a time in the grouped matmuls, except under QAT, which rounds each MoE layer's
    # whole W + s A B (bf16, this device's share)
    params_bytes = (sum(_bytes_per_device(x) for x in jax.tree.leaves(trainable))
                    + (_dequantised_layer_bytes(state["params"]) if spec.qat else 0))
  sizes = _mesh_size(mesh)
  rows_dev = (batch // accum) // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
  common = dict(topology=topology, devices=n, mesh=format_sizes(sizes), batch=batch, seq=seq,
                grad_accum=accum, remat=ex.remat.value, loss_chunk=ex.loss_chunk,
                attention=ex.attention.value,
                hbm_bytes_per_device=chip.hbm_bytes, model_flops=model_flops,
                state_bytes_per_device=state_bytes, param_count=n_params,
                mode="lora" if lora else "train", lora_rank=spec.rank if lora else None,
                trainable_param_count=step_lib.count_params(trainable) if lora else None,
                remat_flops=remat_flops, optimizer_flops=optimizer_flops)
  if analytic:
    arg = state_bytes + batch_bytes
    temp = analytic_temp(cfg, ex, rows_dev, seq, sizes["tensor"], state_bytes, params_bytes,
                         moe_layer_bytes(cfg, ex, mesh, batch // accum * seq),
                         accum=accum, largest_per_device=0.0 if lora else largest)
    peak = arg + temp
    # per device: the model FLOPs share plus remat's recompute (one more forward)
    per_dev = model_flops / n * (4 / 3 if ex.remat != Remat.NONE else 1.0)
    est = max(per_dev / chip.peak_flops, (state_bytes * 3 + temp) / chip.hbm_bandwidth)
    return Plan(**common, analytic=True, argument_bytes_per_device=arg,
                temp_bytes_per_device=temp, output_bytes_per_device=state_bytes,
                alias_bytes_per_device=state_bytes, peak_bytes_per_device=peak,
                fits=peak <= chip.hbm_bytes, compile_seconds=None, compiled_flops=None,
                compiled_bytes_accessed=None, flops_ratio=None, step_seconds_estimate=est)

  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = steps.train.jitted.trace(state, data, thr).lower(lowering_platforms=("tpu",))
  try:
    # (neither xla_tpu_max_hbm_size_mib above the chip's HBM nor xla_tpu_no_crash_on_oom
    # helps: the first is ignored, the second searches for a fitting schedule for > 10 min)
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001  (XLA's compile-time HBM check: JaxRuntimeError)
    total = oom_temporaries(str(e))
    if total is None:
      raise
    # the TPU compiler refuses a program that cannot fit and gives only its total (see
    # oom_temporaries: the arguments included)
    seconds = time.perf_counter() - t0
    arg = state_bytes + batch_bytes
    return Plan(**common, analytic=False, argument_bytes_per_device=arg,
                temp_bytes_per_device=max(0.0, total - arg),
                output_bytes_per_device=state_bytes,
                alias_bytes_per_device=state_bytes, peak_bytes_per_device=total,
                fits=False, compile_seconds=seconds, compiled_flops=None,
                compiled_bytes_accessed=None, flops_ratio=None,
                step_seconds_estimate=math.nan, compile_oom=True)
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
  alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
  peak = getattr(mem, "peak_memory_in_bytes", 0) or (arg + out - alias + temp)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  dev_flops = float(cost.get("flops", 0.0))
  dev_bytes = float(cost.get("bytes accessed", 0.0))
  text = compiled.as_text()
  # cost_analysis counts each loop body once (the layer scan, the micro-batches): the ratio
  # and its split come from the matmul FLOPs with loops by their trip counts instead
  by_op: dict = {}
  counted = hlo.matmul_flops(text, by_op) * n
  grouped = sum(f for op, f in by_op.items() if _grouped_matmul_op(op)) * n
  tokens = batch // accum * seq
  buffer_rows = grouped * (1.0 - routed_fill(cfg, ex, mesh, tokens))
  skipped = 0.0
  if ex.moe_grouped_matmul == GroupedMatmul.MEGABLOX:  # its grid stops at the group sizes
    skipped = grouped * (1.0 - grouped_rows_run(cfg, ex, mesh, tokens))
  work, buffer_rows = counted - skipped, buffer_rows - skipped
  est = max(work / n / chip.peak_flops, dev_bytes / chip.hbm_bandwidth)
  return Plan(**common, analytic=False, loops=text.count(" while("),
              argument_bytes_per_device=arg,
              temp_bytes_per_device=temp, output_bytes_per_device=out,
              alias_bytes_per_device=alias, peak_bytes_per_device=peak,
              fits=peak <= chip.hbm_bytes, compile_seconds=seconds,
              compiled_flops=dev_flops * n, compiled_bytes_accessed=dev_bytes * n,
              compiled_matmul_flops=counted, work_flops=work, skipped_row_flops=skipped,
              flops_ratio=work / model_flops if model_flops else None,
              step_seconds_estimate=est,
              buffer_row_flops=buffer_rows,
              other_flops=work - model_flops - remat_flops - optimizer_flops - buffer_rows)


_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\)")


def oom_temporaries(message: str) -> float | None:
  """The bytes in XLA's compile-time HBM OOM message ('... the total memory required for HLO
  temporaries (33.54G) exceeds available HBM (15.75G)'), None for any other error. Despite the
  wording the figure is the whole program's HBM: the arguments' buffers plus the temporaries'
  heap (in the buffer assignment that XLA_FLAGS=--xla_dump_to writes for the refused
  program, the parameter allocations and the preallocated temporaries sum to it:
  docs/plan.md#what-got-it-there)."""
  m = _OOM.search(message)
  if not m:
    return None
  return float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")


def candidate_meshes(cfg, n: int, rows: int) -> list[dict]:
  """A small set of (data, fsdp, expert, tensor) splits of n devices: experts over as many
  devices as divide E, heads over tensor in {1, 2, 4, 8}, the rest fsdp (weights sharded)
  or data; only splits whose batch axes divide the rows."""
  out = []
  heads = math.gcd(cfg.mla_num_heads, cfg.kda_num_heads)
  for tensor in (1, 2, 4, 8):
    if n % tensor or heads % tensor:
      continue
    rest = n // tensor
    for expert in sorted({math.gcd(rest, cfg.num_experts), 1}, reverse=True):
      for fsdp in (rest // expert, 1):
        data = rest // expert // fsdp
        sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
        if rows % (data * fsdp * expert) == 0 and sizes not in out:
          out.append(sizes)
  return out


def run_plan(args) -> list[Plan]:
  import configs  # noqa: PLC0415
  from k3jax.train import step as step_lib  # noqa: PLC0415
  from sharding.mesh import MeshError  # noqa: PLC0415

  cfg = configs.resolve(args.config)
  ex = plan_config(args.remat, args.attention, args.loss_chunk,
                   getattr(args, "capacity_factor", None))
  spec = lora_spec(args, cfg)
  if args.batch % args.grad_accum:
    raise UserError(f"--batch {args.batch} is not a multiple of --grad-accum {args.grad_accum}")
  devices = topology_devices(args.topology)
  sc = step_lib.StepConfig(qb_method="histogram")  # the histogram QB scales to pods
  kw = dict(batch=args.batch, seq=args.seq, accum=args.grad_accum, spec=spec)
  if args.mesh:
    return [plan_one(cfg, ex, sc, devices, args.topology, args.mesh, analytic=args.analytic,
                     **kw)]
  cands = candidate_meshes(cfg, len(devices), args.batch // args.grad_accum)
  ranked = []
  for sizes in cands:  # analytic first: cheap, and orders the compiles
    try:
      ranked.append(plan_one(cfg, ex, sc, devices, args.topology, sizes, analytic=True, **kw))
    except MeshError:
      continue
  if not ranked:
    raise UserError(f"no mesh of {len(devices)} devices splits this model and batch")
  ranked.sort(key=lambda p: p.peak_bytes_per_device)
  if args.analytic:
    return ranked
  plans = []
  for p in ranked[:args.max_compiles]:
    plans.append(plan_one(cfg, ex, sc, devices, args.topology, p.mesh, analytic=False, **kw))
  return plans


def lora_spec(args, cfg):
  """The AdaptSpec `--mode lora` plans (None for --mode train), checked against the model."""
  from flax import nnx  # noqa: PLC0415

  from k3jax.model import lora  # noqa: PLC0415
  from k3jax.model.transformer import K3Model  # noqa: PLC0415
  if getattr(args, "mode", "train") != "lora":
    return None
  if args.lora <= 0:
    raise UserError(f"--lora RANK must be > 0, got {args.lora}")
  if args.base_experts == "mxfp4" and not cfg.moe_layers:
    raise UserError("--base-experts mxfp4: the model has no routed experts")
  spec = lora.AdaptSpec(rank=args.lora, targets=tuple(args.lora_targets or lora.DEFAULT_TARGETS),
                        base_experts=args.base_experts)
  try:
    lora.matching(spec, nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
  except ValueError as e:
    raise UserError(str(e)) from None
  return spec


def best(plans: list) -> Plan:
  """The fastest estimate that fits (train, LoRA or decode plans), else the smallest peak."""
  fitting = [p for p in plans if p.fits]
  if fitting:
    return min(fitting, key=lambda p: p.step_seconds_estimate)
  return min(plans, key=lambda p: p.peak_bytes_per_device)


def gib(x) -> str:
  return f"{x / GIB:8.2f} GiB"


def report(plan: Plan) -> str:
  kind = "analytic (no compile)" if plan.analytic else "compiled (XLA memory/cost analysis)"
  lines = [
      f"plan: {plan.topology} ({plan.devices} devices), mesh {plan.mesh}, batch {plan.batch} x "
      f"seq {plan.seq} (grad accum {plan.grad_accum}), remat {plan.remat}, loss chunk "
      f"{plan.loss_chunk or 'none'}, attention {plan.attention}"
      + (f", LoRA r={plan.lora_rank} over a frozen base" if plan.mode == "lora" else "")
      + f": {kind}",
      f"  parameters      {plan.param_count / 1e9:10.3f} B"
      + (f" ({plan.trainable_param_count / 1e9:.3f} B trainable)" if plan.mode == "lora"
         else "") + f"; train state per device {gib(plan.state_bytes_per_device)}",
      f"  arguments       {gib(plan.argument_bytes_per_device)} per device",
      f"  temporaries     {gib(plan.temp_bytes_per_device)} per device",
      f"  peak            {gib(plan.peak_bytes_per_device)} of {gib(plan.hbm_bytes_per_device)}"
      f" HBM: {'FITS' if plan.fits else 'does NOT fit'} "
      f"({plan.peak_bytes_per_device / plan.hbm_bytes_per_device:.0%})",
  ]
  if plan.compile_oom:
    lines += [f"  compile         {plan.compile_seconds:8.1f} s: refused by the TPU compiler "
              "(HBM); the peak from its message, no cost analysis",
              "                  (where it goes: XLA_FLAGS=--xla_dump_to=DIR, then "
              "benchmarks/xla_heap.py DIR)"]
  elif plan.compile_seconds is not None:
    lines += [
        f"  compile         {plan.compile_seconds:8.1f} s",
        f"  FLOPs           compiled matmuls {plan.work_flops:.3e} / model "
        f"{plan.model_flops:.3e} = {plan.flops_ratio:.3f} (loops by trip count; XLA's "
        f"cost_analysis, each of {plan.loops} loop bodies once: {plan.compiled_flops:.3e})",
        *([f"                  (counted {plan.compiled_matmul_flops:.3e}, less "
           f"{plan.skipped_row_flops:.3e} of expert buffer rows past the group sizes that "
           "the megablox kernels' grid never runs)"] if plan.skipped_row_flops else []),
        f"    split         model 1.000, remat recompute "
        f"{plan.remat_flops / plan.model_flops:.3f}, optimizer (Newton-Schulz) "
        f"{plan.optimizer_flops / plan.model_flops:.3f}, expert buffer rows past the "
        f"routed pairs {plan.buffer_row_flops / plan.model_flops:.3f}, other (waste) "
        f"{plan.other_flops / plan.model_flops:.3f} (of the model FLOPs)",
        f"  bytes accessed  {plan.compiled_bytes_accessed:.3e} (all devices; cost_analysis: "
        "loop bodies once)"]
  else:
    lines.append(f"  FLOPs           model {plan.model_flops:.3e}; by hand, remat recompute "
                 f"{plan.remat_flops / plan.model_flops:.3f} and optimizer "
                 f"{plan.optimizer_flops / plan.model_flops:.3f} of that on top")
  lines.append(f"  step time       {plan.step_seconds_estimate:.3f} s  (ESTIMATE: roofline of "
               "peak FLOP/s and HBM bandwidth, no communication)")
  return "\n".join(lines)
