"""`k3jax plan --mode decode`: will serving fit a TPU slice, on which mesh, how many tokens/s.

What `k3jax generate` runs on TPU (k3jax/generate/static_batch.py, the stacked layout: layers
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
temporaries by hand (see `analytic_temp`).
"""

from __future__ import annotations

import dataclasses
import math
import time

from k3jax.errors import UserError
from k3jax.execution import Execution, GroupedMatmul, KdaBackend, Precision
from k3jax.plan.train import chip_of, gib, oom_temporaries, topology_devices
from k3jax.plan.analytic import _bytes_per_device
from k3jax.plan import hlo


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

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def serve_config(capacity_factor: float | None = None) -> Execution:
  """The execution `k3jax generate --dtype bfloat16` runs on TPU: bf16 weights and compute,
  megablox experts, KDA's Pallas TPU kernel for prefill (decode runs its fused step); the
  routed experts dropless unless a capacity factor is given."""
  return Execution(dtype="bfloat16", param_dtype="bfloat16", matmul_precision=Precision.DEFAULT,
                   moe_grouped_matmul=GroupedMatmul.MEGABLOX, kda_backend=KdaBackend.PALLAS_TPU,
                   moe_capacity_factor=capacity_factor)


def abstract_inputs(cfg, ex, mesh, batch: int, seq: int):
  """(graphdef, params, cache): the model's arrays and an empty cache as ShapeDtypeStructs in
  their shardings on `mesh` (nothing allocated)."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415

  from k3jax.model import cache as cache_lib  # noqa: PLC0415
  from k3jax.model.transformer import K3Model  # noqa: PLC0415
  from sharding.placement import check_model_fits, variable_spec  # noqa: PLC0415

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
      cache, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  return graphdef, params, cache


def analytic_temp(cfg, mesh, rows: int, tokens: int, seq: int, moe_bytes: float) -> float:
  """Per-device temporaries of one `extend` of `tokens` new tokens on each of `rows` rows
  (this device's rows), by hand, with the compute dtype's width c = 2:
    logits          [rows, tokens, V / tensor] in c, and the sampler's [rows, V] fp32 x 4
                    (scaled, sorted, probabilities, their cumulative sum);
    the carry       AttnRes's sealed blocks and partial sum [n_seals + 1, rows, tokens, d] x 2
                    (the scan's carry in and out);
    one layer       ~12 [rows, tokens, d] tensors, and the widest per-head tensor: MLA's
                    absorbed scores [rows, H / tensor, tokens, seq] in fp32 x 2, or KDA's
                    chunk tensors [rows, tokens, H / tensor, 128] fp32 x 8 in prefill;
    the MLA cache   one layer's slice [rows, seq, kv_lora + rope] read out of the stack;
    one MoE layer   `moe_bytes` (k3jax/plan.moe_layer_bytes for rows x tokens tokens)."""
  from k3jax.model import schedule  # noqa: PLC0415
  c, d = 2, cfg.hidden_size
  tensor = dict(mesh.shape).get("tensor", 1)
  btd = rows * tokens * d
  logits = rows * tokens * math.ceil(cfg.vocab_size / tensor) * c + rows * cfg.vocab_size * 4 * 4
  seals = schedule.num_seals(cfg) if cfg.attn_res_block_size is not None else 0
  carry = (seals + 1) * btd * c * 2
  h = max(1, cfg.mla_num_heads // tensor)
  scores = rows * h * tokens * seq * 4 * 2 if cfg.mla_layers else 0
  kda = rows * tokens * max(1, cfg.kda_num_heads // tensor) * cfg.kda_head_dim * 8 * 4 if (
      tokens > 1 and cfg.kda_layers) else 0
  latent = rows * seq * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * c if cfg.mla_layers else 0
  return logits + carry + 12 * btd * 4 + max(scores, kda) + latent + moe_bytes


def plan_one(cfg, ex, devices, topology: str, mesh_spec, *, batch: int, seq: int,
             prefill_chunk: int, block: int, analytic: bool) -> DecodePlan:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from k3jax.generate.static_batch import decode_block, extend_jit  # noqa: PLC0415
  from k3jax.generate.sampling import Sampling  # noqa: PLC0415
  from k3jax.plan.analytic import moe_layer_bytes  # noqa: PLC0415
  from k3jax.train import flops as flops_lib  # noqa: PLC0415
  from sharding.mesh import format_sizes, make_mesh  # noqa: PLC0415
  from sharding.placement import batch_rows_ways, check_batch  # noqa: PLC0415

  mesh = make_mesh(mesh_spec, devices)
  check_batch(batch, mesh, "--batch rows")
  graphdef, params, cache = abstract_inputs(cfg, ex, mesh, batch, seq)
  chip = chip_of(topology, devices[0].device_kind)
  n = len(devices)
  weights = sum(_bytes_per_device(x) for x in jax.tree.leaves(params))
  cache_bytes = sum(_bytes_per_device(x) for x in jax.tree.leaves(cache))
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  model_flops = batch * flops_lib.decode_per_token(cfg, seq)
  common = dict(topology=topology, devices=n, mesh=format_sizes(dict(mesh.shape)), batch=batch,
                seq=seq, prefill_chunk=prefill_chunk, block=block, mode="decode",
                hbm_bytes_per_device=chip.hbm_bytes, weight_bytes_per_device=weights,
                cache_bytes_per_device=cache_bytes, model_flops=model_flops,
                param_count=n_params)
  rows = batch // batch_rows_ways(mesh)
  if analytic:
    temps = [analytic_temp(cfg, mesh, rows, t, seq,
                           moe_layer_bytes(cfg, ex, mesh, batch * t) / 2)
             for t in (prefill_chunk, 1)]  # no gradients: half plan.moe_layer_bytes' gather
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
  rows_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(row_axes))
  rows2 = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(row_axes, None))
  ids = sd((batch, prefill_chunk), jnp.int32, sharding=rows2)
  logits = sd((batch, cfg.vocab_size), ex.jnp_dtype, sharding=rows2)
  key = jax.eval_shape(lambda: jax.random.key(0))
  sampling = jax.eval_shape(lambda: Sampling.make(0.0, 0, 1.0))
  t0 = time.perf_counter()
  results = []
  with jax.set_mesh(mesh):
    lowered = [
        extend_jit.trace(static, params, ids, cache).lower(lowering_platforms=("tpu",)),
        decode_block.trace(static, block, params, cache, logits, key,
                           sd((batch,), jnp.bool_, sharding=rows_sh),
                           sd((batch,), jnp.int32, sharding=rows_sh), sd((), jnp.int32),
                           sd((1,), jnp.int32), sampling).lower(lowering_platforms=("tpu",))]
  oom = False
  for low in lowered:
    try:
      results.append(low.compile())
    except Exception as e:  # noqa: BLE001  (XLA's compile-time HBM check)
      temp = oom_temporaries(str(e))
      if temp is None:
        raise
      results.append(temp)
      oom = True
  seconds = time.perf_counter() - t0
  temps, peaks = [], []
  for r in results:
    if isinstance(r, float):  # the OOM message's total, the arguments included
      temps.append(max(0.0, r - weights - cache_bytes))
      peaks.append(r)
      continue
    mem = r.memory_analysis()
    temps.append(mem.temp_size_in_bytes)
    peaks.append(getattr(mem, "peak_memory_in_bytes", 0) or (
        mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes))
  flops = bytes_ = None
  est = math.nan
  if not isinstance(results[1], float):
    # FLOPs: the matmuls with the loops by their trip counts (the block's `block` steps, the
    # layer scan inside each), per step; bytes: cost_analysis (the loop bodies once: a step)
    flops = hlo.matmul_flops(results[1].as_text()) / block
    cost = results[1].cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    bytes_ = float(cost.get("bytes accessed", 0.0))
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


def candidate_meshes(cfg, n: int, batch: int) -> list[dict]:
  """Serving splits of n devices: heads over tensor (up to 8, what divides the heads), the
  experts over as many of the rest as divide E, then data (rows; the weights replicated) or,
  when nothing else is left, fsdp; only splits whose batch axes divide the rows."""
  out = []
  heads = math.gcd(cfg.mla_num_heads or 0, cfg.kda_num_heads or 0) or 1
  for tensor in (8, 4, 2, 1):
    if n % tensor or heads % tensor:
      continue
    rest = n // tensor
    expert = math.gcd(rest, cfg.num_experts) if cfg.num_experts else 1
    for sizes in ({"data": rest // expert, "fsdp": 1, "expert": expert, "tensor": tensor},
                  {"data": 1, "fsdp": rest // expert, "expert": expert, "tensor": tensor}):
      if batch % (sizes["data"] * sizes["fsdp"] * sizes["expert"]) == 0 and sizes not in out:
        out.append(sizes)
  return out


def run_plan(args) -> list[DecodePlan]:
  import configs  # noqa: PLC0415
  from sharding.mesh import MeshError  # noqa: PLC0415

  cfg, ex = configs.resolve(args.config), serve_config(args.capacity_factor)
  devices = topology_devices(args.topology)
  chunk = min(args.prefill_chunk, args.seq)
  kw = dict(batch=args.batch, seq=args.seq, prefill_chunk=chunk, block=args.block)
  try:
    if args.mesh:
      return [plan_one(cfg, ex, devices, args.topology, args.mesh, analytic=args.analytic,
                       **kw)]
    ranked = []
    for sizes in candidate_meshes(cfg, len(devices), args.batch):
      try:
        ranked.append(plan_one(cfg, ex, devices, args.topology, sizes, analytic=True, **kw))
      except MeshError:
        continue
  except MeshError as e:
    raise UserError(str(e)) from None
  if not ranked:
    raise UserError(f"no serving mesh of {len(devices)} devices splits this model and "
                    f"--batch {args.batch}")
  ranked.sort(key=lambda p: (not p.fits, -p.tokens_per_second_estimate))
  if args.analytic:
    return ranked
  return [plan_one(cfg, ex, devices, args.topology, p.mesh, analytic=False, **kw)
          for p in ranked[:args.max_compiles]]


def report(plan: DecodePlan) -> str:
  kind = "analytic (no compile)" if plan.analytic else "compiled (XLA memory/cost analysis)"
  lines = [
      f"plan: {plan.topology} ({plan.devices} devices), mesh {plan.mesh}, decode {plan.batch} "
      f"rows x {plan.seq} positions (prefill chunk {plan.prefill_chunk}, block {plan.block}), "
      f"bf16 weights: {kind}",
      f"  parameters      {plan.param_count / 1e9:10.3f} B",
      f"  weights         {gib(plan.weight_bytes_per_device)} per device",
      f"  cache           {gib(plan.cache_bytes_per_device)} per device",
      f"  temporaries     {gib(plan.prefill_temp_bytes_per_device)} prefill, "
      f"{gib(plan.decode_temp_bytes_per_device).strip()} decode, per device",
      f"  peak            {gib(plan.peak_bytes_per_device)} of {gib(plan.hbm_bytes_per_device)}"
      f" HBM: {'FITS' if plan.fits else 'does NOT fit'} "
      f"({plan.peak_bytes_per_device / plan.hbm_bytes_per_device:.0%})"]
  if plan.compile_oom:
    lines.append(f"  compile         {plan.compile_seconds:8.1f} s: refused by the TPU compiler "
                 "(HBM); temporaries from its message")
  elif plan.compile_seconds is not None:
    lines += [f"  compile         {plan.compile_seconds:8.1f} s (prefill + decode)",
              f"  FLOPs / step    compiled {plan.compiled_flops:.3e} / model "
              f"{plan.model_flops:.3e} = {plan.flops_ratio:.3f}",
              f"  bytes / step    {plan.compiled_bytes_accessed:.3e} (all devices)"]
  else:
    lines.append(f"  FLOPs / step    model {plan.model_flops:.3e}")
  if not math.isnan(plan.step_seconds_estimate):
    lines.append(f"  decode step     {plan.step_seconds_estimate * 1e3:.2f} ms, "
                 f"{plan.tokens_per_second_estimate:,.0f} tokens/s  (ESTIMATE: roofline of "
                 "peak FLOP/s and HBM bandwidth, no communication)")
  return "\n".join(lines)
