"""`k3jax plan --mode decode`: will serving fit a TPU slice, on which mesh, how many tokens/s.

Two serving models (`--serving`):

  engine  the serving engine `k3jax generate` runs on (k3jax/engine, docs/serving.md):
          `--batch` slots of up to `--seq` positions; counted by hand (`--analytic` only:
          the engine's step is not compiled by the plan yet, a known gap). Per device: the
          weights (routed experts packed as MXFP4 unless `--experts dequantized`), the KDA
          slots, the latent page pool (`--page-size`, `--num-pages`), the prefix cache's KDA
          snapshots (`--prefix-snapshots`): exactly from the shapes `paged.init_cache`
          builds, placed as `paged.place` places them (k3jax/plan/engine_memory.py); the
          step's temporaries by hand (analytic.engine_temp). `--max-fit` adds the largest
          batch that fits at `--seq`.
  static  the static left-padded batch (k3jax/generate/static_batch.py), compiled or counted
          (below). Without `--serving` a compiled plan models this one, an analytic plan the
          engine.

The static batch on TPU (k3jax/generate/static_batch.py, the stacked layout: layers
scanned, weights and cache stacked) is lowered with abstract sharded inputs and compiled ahead
of time for the topology, like the train plan (k3jax/plan/train.py):

  prefill   `extend` on one chunk of `--prefill-chunk` prompt tokens per row (the shape every
            prefill call compiles to), the cache donated;
  decode    `decode_block`: `--block` sampled tokens per call (a while loop of one-token
            `extend`s), the cache donated.

Inputs per device: the weights in bf16 (`generate --dtype bfloat16`; the routed experts
dequantised as loaded) in the rules table's shardings, and a cache of `--batch` rows and
`--seq` positions (the longest prompt + new tokens the server takes) in its own (k3jax/model/
cache.py: rows over the batch axes, KDA heads over tensor). The plan reports the larger of
the two programs' peaks against the chip's HBM, and per decode step (one token for every row)
the compiled matmul FLOPs (k3jax/plan/hlo.matmul_flops: the block's loop and the layer scan by
their trip counts, over `--block`) and bytes (cost_analysis, which counts a loop body once:
one step). The step time is an ESTIMATE, max(FLOPs / peak, bytes / bandwidth);
decode is bandwidth-bound (every step reads the weights the rows' experts need and the whole
cache), and the estimate has no communication: on fsdp meshes each step also gathers the
weights over fsdp, which serving meshes avoid (weights split over expert and tensor only).

`--analytic` counts instead: the weights and the cache exactly from their sharded shapes, the
temporaries by hand (k3jax/plan/analytic.py's `decode_temp`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.config import ModelConfig
from k3jax.engine.config import EngineConfig
from k3jax.errors import UserError
from k3jax.execution import Execution, GroupedMatmul, KdaBackend, Precision
from k3jax.generate.sampling import Sampling
from k3jax.generate.static_batch import decode_block, extend_jit
from k3jax.model import cache as cache_lib
from k3jax.model.transformer import K3Model
from k3jax.plan import engine_memory, hlo, report
from k3jax.plan.analytic import bytes_per_device, decode_temp, engine_temp, moe_layer_bytes
from k3jax.plan.chips import chip_of
from k3jax.plan.compiled import compile_or_refusal, cost_analysis, peak_bytes
from k3jax.plan.request import Experts, Mode, PlanRequest, Serving
from k3jax.plan.search import search
from k3jax.train import flops as flops_lib
from sharding.mesh import format_sizes, make_mesh
from sharding.placement import batch_rows_ways, check_batch, check_model_fits, variable_spec


@dataclasses.dataclass
class DecodePlan:
  """One mesh's serving figures (bytes per device; FLOPs of one decode step, all rows)."""
  topology: str
  devices: int
  mesh: str
  batch: int
  seq: int                    # cache positions per row (prompt + new tokens)
  prefill_chunk: int
  block: int
  mode: str
  analytic: bool
  hbm_bytes_per_device: float
  weight_bytes_per_device: float
  cache_bytes_per_device: float
  prefill_temp_bytes_per_device: float
  decode_temp_bytes_per_device: float
  peak_bytes_per_device: float   # max over the two programs
  fits: bool
  compile_seconds: float | None
  compiled_flops: float | None   # one decode step (every row one token), all devices: matmuls
  compiled_bytes_accessed: float | None
  model_flops: float             # one decode step: batch x forward FLOPs of a token at --seq
  flops_ratio: float | None
  step_seconds_estimate: float   # one decode step
  tokens_per_second_estimate: float
  param_count: int
  compile_oom: bool = False
  serving: str = Serving.STATIC.value
  experts: str = Experts.DEQUANTIZED.value
  # the engine's cache (--serving engine; None for the static batch): its sizes, and one
  # device's bytes by part (they sum to cache_bytes_per_device)
  page_size: int | None = None
  pool_pages: int | None = None               # pages that hold tokens (+ 1 scratch held)
  snapshots: int | None = None
  kda_slot_bytes_per_device: float | None = None
  latent_page_bytes_per_device: float | None = None
  snapshot_bytes_per_device: float | None = None
  max_fit_batch: int | None = None             # --max-fit: the most slots at --seq that fit
  data_shards: int | None = None               # the engine's pool shards (over the batch axes)
  context_shards: int | None = None            # the pages' stripes over `context` (by position)
  # weights a device gathers over fsdp per step (not in the step estimate), and that over its
  # ICI links at full speed (None: the chip's ICI is not known)
  fsdp_gather_bytes_per_device: float | None = None
  fsdp_gather_seconds: float | None = None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def report(self) -> str:
    """The plan as text, a few lines."""
    p = self
    engine = p.serving == Serving.ENGINE
    if engine:
      lines = [
          f"plan: {p.topology} ({p.devices} devices), mesh {p.mesh}, serving engine: "
          f"{p.batch} slots x {p.seq} positions (pages of {p.page_size}: {p.pool_pages}, "
          f"{p.snapshots} snapshots, prefill chunk {p.prefill_chunk}, {p.data_shards} pool "
          f"shard{'s' if p.data_shards != 1 else ''}{_stripes(p)}), {p.experts} experts: "
          f"{report.method(p)}",
          f"  parameters      {p.param_count / 1e9:10.3f} B",
          f"  weights         {report.gib(p.weight_bytes_per_device)} per device",
          f"  KDA slots       {report.gib(p.kda_slot_bytes_per_device)} per device",
          f"  latent pages    {report.gib(p.latent_page_bytes_per_device)} per device",
          f"  snapshots       {report.gib(p.snapshot_bytes_per_device)} per device",
          f"  temporaries     {report.gib(p.prefill_temp_bytes_per_device)} mixed step, "
          f"{report.gib(p.decode_temp_bytes_per_device).strip()} decode step, per device",
          report.peak(p)]
    else:
      weights = "bf16" if p.experts == Experts.DEQUANTIZED else "bf16 + MXFP4 expert"
      lines = [
          f"plan: {p.topology} ({p.devices} devices), mesh {p.mesh}, decode {p.batch} "
          f"rows x {p.seq} positions (prefill chunk {p.prefill_chunk}, block {p.block}), "
          f"{weights} weights: {report.method(p)}",
          f"  parameters      {p.param_count / 1e9:10.3f} B",
          f"  weights         {report.gib(p.weight_bytes_per_device)} per device",
          f"  cache           {report.gib(p.cache_bytes_per_device)} per device",
          f"  temporaries     {report.gib(p.prefill_temp_bytes_per_device)} prefill, "
          f"{report.gib(p.decode_temp_bytes_per_device).strip()} decode, per device",
          report.peak(p)]
    if p.compile_oom:
      lines.append(report.refused(p, "temporaries from its message"))
    elif p.compile_seconds is not None:
      lines += [f"  compile         {p.compile_seconds:8.1f} s (prefill + decode)",
                f"  FLOPs / step    compiled {p.compiled_flops:.3e} / model "
                f"{p.model_flops:.3e} = {p.flops_ratio:.3f}",
                f"  bytes / step    {p.compiled_bytes_accessed:.3e} (all devices)"]
    else:
      lines.append(f"  FLOPs / step    model {p.model_flops:.3e}")
    if not math.isnan(p.step_seconds_estimate):
      lines.append(f"  decode step     {p.step_seconds_estimate * 1e3:.2f} ms, "
                   f"{p.tokens_per_second_estimate:,.0f} tokens/s  {report.ESTIMATE}")
    if p.fsdp_gather_bytes_per_device:
      time = ("" if p.fsdp_gather_seconds is None else
              f", at least {p.fsdp_gather_seconds * 1e3:.1f} ms over ICI")
      lines.append(f"  fsdp gathers    {report.gib(p.fsdp_gather_bytes_per_device).strip()} of "
                   f"weights per device per step{time} (not in the estimate)")
    if p.max_fit_batch is not None:
      lines.append(f"  max fit         {p.max_fit_batch} slots x {p.seq} positions")
    return "\n".join(lines)


def _stripes(p: DecodePlan) -> str:
  stripes = p.context_shards or 1
  return f", pages by position over context={stripes}" if stripes > 1 else ""


def serve_execution(request: PlanRequest) -> Execution:
  """The execution `k3jax generate --dtype bfloat16` runs on TPU: bf16 weights and compute,
  megablox experts, KDA's Pallas TPU kernel for prefill (decode runs its fused step); the
  routed experts dropless unless the request gives a capacity factor."""
  return Execution(dtype="bfloat16", param_dtype="bfloat16", matmul_precision=Precision.DEFAULT,
                   moe_grouped_matmul=GroupedMatmul.MEGABLOX, kda_backend=KdaBackend.PALLAS_TPU,
                   moe_capacity_factor=request.capacity_factor or None)


def abstract_inputs(cfg, ex, mesh, batch: int, seq: int):
  """(graphdef, params, cache): the model's arrays and an empty cache as ShapeDtypeStructs in
  their shardings on `mesh` (nothing allocated)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, ex, rngs=nnx.Rngs(0))))
  check_model_fits(state, mesh)

  def sds(var):
    spec = variable_spec(var, mesh)
    return var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype,
                                            sharding=NamedSharding(mesh, spec)))

  params = jax.tree.map(sds, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, ex, batch, seq))
  specs = cache_lib.specs(cache, mesh)
  cache = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
      cache, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return graphdef, params, cache


def data_shards(request: PlanRequest, mesh) -> int:
  """The engine's pool shards: --data-shards, else the mesh's batch ways (data x fsdp x
  expert: a shard per device) when the slots (and --num-pages, --prefix-snapshots) divide
  into them, else 1 (one pool, whole on every device)."""
  if request.data_shards is not None:
    return request.data_shards
  ways = batch_rows_ways(mesh)
  counts = (request.batch, request.num_pages or 0, request.prefix_snapshots or 0)
  return ways if all(n % ways == 0 for n in counts) else 1


def engine_config(request: PlanRequest, batch: int | None = None,
                  shards: int = 1, stripes: int = 1) -> EngineConfig:
  """The engine `request` describes: `batch` (else the request's) slots of `--seq` positions,
  its pools in `shards` shards, their pages in `stripes` over `context`."""
  try:
    return EngineConfig(max_num_seqs=batch or request.batch, max_model_len=request.seq,
                        page_size=request.page_size, num_pages=request.num_pages,
                        prefill_chunk=min(request.prefill_chunk, request.seq),
                        prefix_snapshots=request.prefix_snapshots, data_shards=shards,
                        context_shards=stripes)
  except ValueError as e:
    raise UserError(f"--mode decode: {e}") from None


def engine_figures(request: PlanRequest, cfg, ex, mesh, weights: int, batch: int,
                   shards: int = 1):
  """(engine config, cache bytes, [mixed, decode-only] step temporaries, peak) per device of
  the engine with `batch` slots in `shards` pool shards on `mesh`, beside `weights` bytes of
  weights."""
  stripes = dict(mesh.shape).get("context", 1)
  config = engine_config(request, batch, shards, stripes)
  try:
    cache = engine_memory.cache_bytes(cfg, ex, config, mesh)
  except ValueError as e:
    raise UserError(f"--mode decode: {e}") from None
  ctx = config.pages_per_seq * config.page_size  # the longest context bucket
  temps = []
  for prefill_rows in (shards * config.prefill_rows, 0):  # up to prefill_rows per shard
    tokens = config.max_num_seqs + prefill_rows * config.prefill_chunk
    temps.append(engine_temp(cfg, mesh, decode_rows=config.max_num_seqs,
                             prefill_rows=prefill_rows, chunk=config.prefill_chunk, ctx=ctx,
                             moe_bytes=moe_layer_bytes(cfg, ex, mesh, tokens) / 2,
                             row_ways=cache.shard_devices, stripes=stripes))
  return config, cache, temps, weights + cache.total + max(temps)


def plan_engine(request: PlanRequest, cfg, ex, devices, mesh_spec, variables) -> DecodePlan:
  """The serving engine's plan on one mesh, by hand (`variables`: the served model's, from
  engine_memory.weight_variables)."""
  batch, seq = request.batch, request.seq
  mesh = make_mesh(mesh_spec, devices)
  chip = chip_of(request.topology, devices[0].device_kind)
  weights = engine_memory.weight_bytes(variables, mesh)
  shards = data_shards(request, mesh)
  config, cache, temps, peak = engine_figures(request, cfg, ex, mesh, weights, batch, shards)
  gathered = engine_memory.fsdp_gather_bytes(variables, mesh)
  n = len(devices)
  model_flops = batch * flops_lib.decode_per_token(cfg, seq)
  # a decode step reads every weight once (at serving batches nearly every expert is routed
  # to), the slots' KDA state and the rows' latent pages (whole on every device)
  est = max(model_flops / n / chip.peak_flops,
            (weights + cache.kda_slots + cache.latent_pages) / chip.hbm_bandwidth)
  context = config.context_shards
  max_fit = None
  if request.max_fit:
    max_fit = engine_memory.largest_multiple(lambda b: engine_figures(
        request, cfg, ex, mesh, weights, b, shards)[3] <= chip.hbm_bytes, shards)
  return DecodePlan(
      topology=request.topology, devices=n, mesh=format_sizes(dict(mesh.shape)), batch=batch,
      seq=seq, prefill_chunk=config.prefill_chunk, block=request.block,
      mode=Mode.DECODE.value, analytic=True, hbm_bytes_per_device=chip.hbm_bytes,
      weight_bytes_per_device=weights, cache_bytes_per_device=cache.total,
      prefill_temp_bytes_per_device=temps[0], decode_temp_bytes_per_device=temps[1],
      peak_bytes_per_device=peak, fits=peak <= chip.hbm_bytes, compile_seconds=None,
      compiled_flops=None, compiled_bytes_accessed=None, model_flops=model_flops,
      flops_ratio=None, step_seconds_estimate=est, tokens_per_second_estimate=batch / est,
      param_count=engine_memory.param_count(variables),
      serving=Serving.ENGINE.value, experts=request.experts_resolved.value,
      page_size=config.page_size, pool_pages=config.pool_pages, snapshots=config.snapshots,
      kda_slot_bytes_per_device=cache.kda_slots,
      latent_page_bytes_per_device=cache.latent_pages,
      snapshot_bytes_per_device=cache.snapshots, max_fit_batch=max_fit, data_shards=shards,
      context_shards=context,
      fsdp_gather_bytes_per_device=gathered,
      fsdp_gather_seconds=gathered / chip.ici_bandwidth if chip.ici_bandwidth else None)


def plan_one(request: PlanRequest, cfg, ex, devices, mesh_spec, *,
             analytic: bool, variables=None) -> DecodePlan:
  """The serving plan on one mesh (a spec string or axis sizes). `variables`: the served
  model's (engine_memory.weight_variables), counted by hand for the engine and for packed
  experts; None: the static batch's bf16 model."""
  if request.serving_resolved == Serving.ENGINE:
    return plan_engine(request, cfg, ex, devices, mesh_spec, variables)
  batch, seq, block = request.batch, request.seq, request.block
  prefill_chunk = min(request.prefill_chunk, seq)
  mesh = make_mesh(mesh_spec, devices)
  check_batch(batch, mesh, "--batch rows")
  graphdef, params, cache = abstract_inputs(cfg, ex, mesh, batch, seq)
  chip = chip_of(request.topology, devices[0].device_kind)
  n = len(devices)
  if variables is not None:  # packed experts, counted by hand
    weights = engine_memory.weight_bytes(variables, mesh)
    n_params = engine_memory.param_count(variables)
  else:
    weights = sum(bytes_per_device(x) for x in jax.tree.leaves(params))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  cache_bytes = sum(bytes_per_device(x) for x in jax.tree.leaves(cache))
  model_flops = batch * flops_lib.decode_per_token(cfg, seq)
  common = dict(topology=request.topology, devices=n, mesh=format_sizes(dict(mesh.shape)),
                batch=batch, seq=seq, prefill_chunk=prefill_chunk, block=block,
                mode=Mode.DECODE.value, hbm_bytes_per_device=chip.hbm_bytes,
                weight_bytes_per_device=weights, cache_bytes_per_device=cache_bytes,
                model_flops=model_flops, param_count=n_params,
                experts=request.experts_resolved.value)
  rows = batch // batch_rows_ways(mesh)
  if analytic:
    temps = [decode_temp(cfg, mesh, rows, t, seq, moe_layer_bytes(cfg, ex, mesh, batch * t) / 2)
             for t in (prefill_chunk, 1)]  # no gradients: half moe_layer_bytes' gather
    peak = weights + cache_bytes + max(temps)
    # a step reads every weight once (at serving batches nearly every expert is routed to)
    # and the cache; its FLOPs are the model's
    est = max(model_flops / n / chip.peak_flops, (weights + cache_bytes) / chip.hbm_bandwidth)
    return DecodePlan(**common, analytic=True, prefill_temp_bytes_per_device=temps[0],
                      decode_temp_bytes_per_device=temps[1], peak_bytes_per_device=peak,
                      fits=peak <= chip.hbm_bytes, compile_seconds=None, compiled_flops=None,
                      compiled_bytes_accessed=None, flops_ratio=None,
                      step_seconds_estimate=est, tokens_per_second_estimate=batch / est)

  static = ("stacked", graphdef)
  sd = jax.ShapeDtypeStruct
  row_axes = cache.start.sharding.spec[0]  # the rows' mesh axes, as the cache splits them
  rows_sh = NamedSharding(mesh, PartitionSpec(row_axes))
  rows2 = NamedSharding(mesh, PartitionSpec(row_axes, None))
  ids = sd((batch, prefill_chunk), jnp.int32, sharding=rows2)
  logits = sd((batch, cfg.vocab_size), ex.jnp_dtype, sharding=rows2)
  key = jax.eval_shape(lambda: jax.random.key(0))
  sampling = jax.eval_shape(lambda: Sampling.make(0.0, 0, 1.0))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = [
        extend_jit.trace(static, params, ids, cache).lower(lowering_platforms=("tpu",)),
        decode_block.trace(static, block, params, cache, logits, key,
                           sd((batch,), jnp.bool_, sharding=rows_sh),
                           sd((batch,), jnp.int32, sharding=rows_sh), sd((), jnp.int32),
                           sd((1,), jnp.int32), sampling).lower(lowering_platforms=("tpu",))]
  results = [compile_or_refusal(low) for low in lowered]  # prefill, decode
  oom = any(isinstance(r, float) for r in results)
  seconds = time.perf_counter() - t0
  temps, peaks = [], []
  for r in results:
    if isinstance(r, float):  # the refusal's total, the arguments included
      temps.append(max(0.0, r - weights - cache_bytes))
      peaks.append(r)
      continue
    mem = r.memory_analysis()
    temps.append(mem.temp_size_in_bytes)
    peaks.append(peak_bytes(mem))
  flops = bytes_ = None
  est = math.nan
  if not isinstance(results[1], float):
    # FLOPs: the matmuls with the loops by their trip counts (the block's `block` steps, the
    # layer scan inside each), per step; bytes: cost_analysis (the loop bodies once: a step)
    flops = hlo.matmul_flops(results[1].as_text()) / block
    bytes_ = float(cost_analysis(results[1]).get("bytes accessed", 0.0))
    est = max(flops / chip.peak_flops, bytes_ / chip.hbm_bandwidth)
    flops, bytes_ = flops * n, bytes_ * n
  peak = max(peaks)
  return DecodePlan(**common, analytic=False, prefill_temp_bytes_per_device=temps[0],
                    decode_temp_bytes_per_device=temps[1], peak_bytes_per_device=peak,
                    fits=not oom and peak <= chip.hbm_bytes, compile_seconds=seconds,
                    compiled_flops=flops, compiled_bytes_accessed=bytes_,
                    flops_ratio=flops / model_flops if flops else None,
                    step_seconds_estimate=est, tokens_per_second_estimate=batch / est,
                    compile_oom=oom)


def candidate_meshes(cfg, n: int, batch: int, *, rows_split: bool = True) -> list[dict]:
  """Serving splits of n devices: heads over tensor (up to 8, what divides the heads), the
  experts over as many of the rest as divide E, then data (rows; the weights replicated) or,
  when nothing else is left, fsdp; with `rows_split` (the static batch, whose rows split over
  the batch axes) only splits whose batch axes divide the rows. The engine (not `rows_split`)
  also tries its latent pages by position over a `context` axis of 2 .. 16 devices taken
  from the rest (the weights replicated over it)."""
  out = []
  heads = math.gcd(cfg.mla_num_heads or 0, cfg.kda_num_heads or 0) or 1
  for tensor in (8, 4, 2, 1):
    if n % tensor or heads % tensor:
      continue
    for context in (1,) if rows_split else (1, 2, 4, 8, 16):
      if (n // tensor) % context:
        continue
      rest = n // tensor // context
      expert = math.gcd(rest, cfg.num_experts) if cfg.num_experts else 1
      for sizes in ({"data": rest // expert, "fsdp": 1, "expert": expert, "tensor": tensor},
                    {"data": 1, "fsdp": rest // expert, "expert": expert, "tensor": tensor}):
        if context > 1:
          sizes = {**sizes, "context": context}
        ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
        if (not rows_split or batch % ways == 0) and sizes not in out:
          out.append(sizes)
  return out


def run(request: PlanRequest, cfg: ModelConfig, devices: list) -> list[DecodePlan]:
  """The serving plans of `request` (its batch given) for `cfg` on `devices`: the candidates
  ranked by what fits first, then by the estimated tokens/s (with --max-fit: by the largest
  batch that fits first)."""
  ex = serve_execution(request)
  engine = request.serving_resolved == Serving.ENGINE
  packed = request.experts_resolved == Experts.MXFP4
  if not request.analytic and (engine or packed or request.max_fit):
    raise UserError("--mode decode: the serving engine, --experts mxfp4 and --max-fit are "
                    "planned --analytic only (the plan compiles the static batch with bf16 "
                    "experts: --serving static --experts dequantized)")
  if request.max_fit and not engine:
    raise UserError("--max-fit: plans the serving engine only (--serving engine)")
  variables = None
  if engine or packed:  # once for every mesh tried
    variables = engine_memory.weight_variables(
        cfg, ex, Experts.MXFP4 if packed else Experts.DEQUANTIZED)
  return search(
      request, lambda mesh, analytic: plan_one(request, cfg, ex, devices, mesh,
                                               analytic=analytic, variables=variables),
      candidate_meshes(cfg, len(devices), request.batch, rows_split=not engine),
      # --max-fit: the mesh that holds the most slots at --seq first
      rank=lambda p: (-(p.max_fit_batch or 0) if request.max_fit else 0, not p.fits,
                      -p.tokens_per_second_estimate),
      nothing_fits=f"no serving mesh of {len(devices)} devices splits this model and "
                   f"--batch {request.batch}")
