"""The hand counts behind `k3jax plan` (k3jax/plan/train.py, decode.py): per-device bytes from
sharded shapes, the temporaries of a train step (`train_temp`) and of a serving call
(`decode_temp`) by what they keep (`plan --analytic`), one MoE layer's transient bytes, and the
routed pairs' share of the experts' receive buffer. Plain arithmetic on a config, a mesh and
abstract shapes: no compile."""

from __future__ import annotations

import math

import jax

from k3jax.execution import Attention, Remat
from k3jax.model import expert_parallel, schedule
from pallas_kernels.grouped_matmul import TILE


def bytes_per_device(sds) -> int:
  """One device's share of an abstract array (its sharding's shard shape) in bytes."""
  shape = sds.sharding.shard_shape(sds.shape) if sds.sharding is not None else sds.shape
  return math.prod(shape) * sds.dtype.itemsize


def moe_layer_bytes(cfg, ex, mesh, tokens: int) -> float:
  """Per-device transient bytes of one routed-experts layer on `mesh` (sharding/
  expert_parallel.py's layout for `tokens` tokens a step), in the compute dtype (c bytes):
    gathered experts  when E does not split over expert x fsdp, each layer all-gathers its
                      E/EP local experts over fsdp (3 matrices h x F/tensor), and its backward
                      holds their gradient before the reduce-scatter: x 2;
    dispatch          the receive buffer (`recv` rows of width h, sized for the worst case
                      unless a capacity factor bounds it), the expert outputs, the return: x 3.
  0 without experts or on one device."""
  if not cfg.num_experts or cfg.moe_layers == () or mesh.size == 1:
    return 0.0
  c = 2 if ex.dtype == "bfloat16" else 4
  in_name = expert_parallel.expert_input_name(cfg)
  h = cfg.latent_size if in_name == "latent" else cfg.hidden_size
  layout = expert_parallel.layout(cfg, tokens, in_name, mesh, ex.moe_capacity_factor)
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  gathered = 0.0
  if layout.gather_axes:
    gathered = 2 * cfg.num_experts / layout.ep * 3 * h * cfg.moe_intermediate_size / size(
        layout.psum_axes) * c
  return gathered + 3 * layout.recv * h * c


def train_temp(cfg, ex, rows_per_device: int, seq: int, tensor: int,
                  state_per_device: float, params_per_device: float, moe_bytes: float = 0.0,
                  accum: int = 1, largest_per_device: float = 0.0,
                  context_seq: int = 0) -> float:
  """Per-device temporaries by hand count (bytes) of `cfg` run as `ex` says (remat,
  attention, loss chunking), with the compute dtype's width c:
    gradients           one fp32 copy of the parameters (`params_per_device`, as sharded),
                        two under gradient accumulation (the accumulator and the
                        micro-batch's gradients);
    optimizer           the state is donated and updated in place, one parameter at a time:
                        beyond the gradients, one parameter's Newton-Schulz (its momentum
                        moved to the layout, the iterate, the output: three fp32 copies of
                        the largest parameter's share, `largest_per_device`);
    saved per layer     under full remat only the layer's input carry survives the forward:
                        the partial sum [b, T, d] (c bytes) per layer (save-attention: and
                        each MLA layer's kept o [b, T, H/tensor, d_v] in c with its fp32 row
                        max and lse); under save-dots also
                        the projections' outputs (`saved_dots_width`; offload: in host
                        memory); without remat every activation of the layer, counted as ~30
                        [b, T, d]-sized tensors;
    AttnRes blocks      the sealed-block buffer [n_seals, b, T, d]: under full remat once,
                        with its fp32 gradient (block_scan rebuilds each layer's buffer from
                        the final one); otherwise in fp32 once per scanned unit (a plain
                        scan saves the carry per iteration);
    one layer's working set in the backward: ~12 [b, T, d] + the widest per-head tensors
                        (MLA's [b, H/tensor, T, T] scores and probs in fp32 when the plain
                        attention runs, KDA's [b, T, H/tensor, 128] x 8 otherwise),
    the loss            logits [b, T, V/tensor] fp32 x 3 (logits, softmax, gradient);
    one MoE layer       `moe_bytes` (moe_layer_bytes: gathered experts, dispatch buffers);
    context parallelism `seq` is a device's positions of the `context_seq` of a row (0: no
                        split): an MLA layer holds the whole row's gathered latents
                        [b, context_seq, kv_lora + rope] in c and their fp32 gradient, and
                        KDA's range carries K more value columns (x 1.5 its working set).
  A cross-check of the compiled figures (tests/k3jax/plan/test_plan.py), not a replacement."""
  c = 2 if ex.dtype == "bfloat16" else 4
  d, b, t = cfg.hidden_size, rows_per_device, seq
  btd = b * t * d
  L = cfg.num_layers
  full = ex.remat in (Remat.FULL, Remat.SAVE_ATTENTION)
  saved = L * btd * (c if full else 30 * c)
  if ex.remat == Remat.SAVE_ATTENTION:
    hm = cfg.mla_num_heads // tensor
    saved += len(cfg.mla_layers) * b * t * hm * (cfg.v_head_dim * c + 2 * 4)
  if ex.remat in (Remat.SAVE_DOTS, Remat.OFFLOAD):
    # the carry and the projections' outputs; offload keeps the latter in host memory
    kept = 0 if ex.remat == Remat.OFFLOAD else saved_dots_width(cfg, tensor)
    saved = L * btd * c + b * t * kept * c
  blocks = 0.0
  if cfg.attn_res_block_size is not None:
    if full:
      blocks = schedule.num_seals(cfg) * btd * (c + 4)
    else:
      blocks = schedule.num_seals(cfg) * btd * 4 * max(1, L // 4)
  h = cfg.mla_num_heads // tensor
  attn = b * h * t * t * 4 * 3 if ex.attention == Attention.DENSE else (
      b * t * h * (cfg.qk_head_dim * 2 + cfg.v_head_dim * 2) * c)
  kda = b * t * (cfg.kda_num_heads // tensor) * cfg.kda_head_dim * 8 * 4
  if context_seq:
    attn += b * context_seq * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * (c + 4)
    kda *= 1.5
  working = 12 * btd * 4 + max(attn, kda)
  loss = b * t * (cfg.vocab_size // tensor) * 4 * 3
  if ex.loss_chunk:
    loss = b * ex.loss_chunk * (cfg.vocab_size // tensor) * 4 * 3
  grads = params_per_device * (2 if accum > 1 else 1)
  return grads + 3 * largest_per_device + saved + blocks + working + loss + moe_bytes


def saved_dots_width(cfg, tensor: int) -> int:
  """Per token, the widths of every layer's projection outputs (matmuls without batch dims),
  which save-dots remat keeps, summed over the layers; heads split over `tensor`."""
  hk, k, hm = cfg.kda_num_heads // tensor, cfg.kda_head_dim, cfg.mla_num_heads // tensor
  d = cfg.hidden_size
  kda = 5 * hk * k + hk + d  # q, k, v, the decay gate, the output gate, beta, o
  mla = ((cfg.q_lora_rank or 0) + hm * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
         + cfg.kv_lora_rank + cfg.qk_rope_head_dim
         + hm * (cfg.qk_nope_head_dim + cfg.v_head_dim) + hm * cfg.v_head_dim + d)
  dense = 2 * cfg.intermediate_size // tensor + d
  moe = (2 * cfg.num_shared_experts * cfg.moe_intermediate_size // tensor + d
         + 2 * (cfg.latent_size or 0) + cfg.num_experts)
  mixers = len(cfg.mla_layers) * mla + len(cfg.kda_layers) * kda
  mlps = len(cfg.moe_layers) * moe + (cfg.num_layers - len(cfg.moe_layers)) * dense
  return mixers + mlps


def decode_temp(cfg, mesh, rows: int, tokens: int, seq: int, moe_bytes: float) -> float:
  """Per-device temporaries of one serving `extend` of `tokens` new tokens on each of `rows`
  rows (this device's rows) against a cache of `seq` positions, by hand, with the compute
  dtype's width c = 2:
    logits          [rows, tokens, V / tensor] in c, and the sampler's [rows, V] fp32 x 4
                    (scaled, sorted, probabilities, their cumulative sum);
    the carry       AttnRes's sealed blocks and partial sum [n_seals + 1, rows, tokens, d] x 2
                    (the scan's carry in and out);
    one layer       ~12 [rows, tokens, d] tensors, and the widest per-head tensor: MLA's
                    absorbed scores [rows, H / tensor, tokens, seq] in fp32 x 2, or KDA's
                    chunk tensors [rows, tokens, H / tensor, 128] fp32 x 8 in prefill;
    the MLA cache   one layer's slice [rows, seq, kv_lora + rope] read out of the stack;
    one MoE layer   `moe_bytes` (moe_layer_bytes for rows x tokens tokens)."""
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


def engine_temp(cfg, mesh, *, decode_rows: int, prefill_rows: int, chunk: int, ctx: int,
                moe_bytes: float, row_ways: int = 1, stripes: int = 1) -> float:
  """Per-device temporaries of one serving-engine step (k3jax/engine/runner.py `_step`) by
  hand: `decode_rows` rows of one token and `prefill_rows` rows of `chunk` tokens (0 rows:
  a decode-only step), every row attending over `ctx` gathered positions; the engine's arrays
  are whole on every device but for the heads over `tensor` and, with pool shards, the tokens
  and the mixers' rows over `row_ways` devices (each runs its shards' tokens; the mixers under
  shard_map), and with the pages in `stripes` over `context` each device's share of a row's
  context, ctx / stripes. n = the step's tokens, m = the rows that draw; compute width c = 2:
    logits          the head's fp32 logits at the m drawing tokens [m, V / tensor]
                    (layers.head_logits), the log-softmax, the filtered logits the reported
                    logprobs are taken under and the sampler's [m, V] fp32 x 6;
    the carry       AttnRes's sealed blocks and partial sum [n_seals + 1, n, d] x 2;
    one layer       ~12 [n, d] fp32 tensors, and the widest mixer's:
                      MLA  each row's context gathered from its pages [rows, ctx, kv_lora +
                           rope] in c, and the absorbed scores [tokens, H / tensor, ctx]
                           fp32 x 2;
                      KDA  each row's start state picked from slot, snapshot or zeros, and
                           the state after: [rows, H / tensor, K, K] fp32 x 4; in prefill the
                           chunk tensors [rows, chunk, H / tensor, K] fp32 x 8;
    one MoE layer   `moe_bytes` (moe_layer_bytes for the n tokens; no gradients: half).
  The cache is donated and written in place."""
  c, d = 2, cfg.hidden_size
  tensor = dict(mesh.shape).get("tensor", 1)
  n = decode_rows + prefill_rows * chunk
  m = decode_rows + prefill_rows
  logits = m * math.ceil(cfg.vocab_size / tensor) * 4 + m * cfg.vocab_size * 4 * 6
  seals = schedule.num_seals(cfg) if cfg.attn_res_block_size is not None else 0
  carry = (seals + 1) * n * d * c * 2 / row_ways
  mla = 0
  if cfg.mla_layers:
    heads = max(1, cfg.mla_num_heads // tensor)
    local = ctx / stripes
    mla = (m * local * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * c
           + n * heads * local * 4 * 2) / row_ways
  kda = 0
  if cfg.kda_layers:
    heads, k = max(1, cfg.kda_num_heads // tensor), cfg.kda_head_dim
    kda = (m * heads * k * k * 4 * 4 + prefill_rows * chunk * heads * k * 8 * 4) / row_ways
  return logits + carry + 12 * n * d * 4 / row_ways + max(mla, kda) + moe_bytes


def routed_fill(cfg, ex, mesh, tokens: int) -> float:
  """Expected routed pairs over the rows of the experts' receive buffer on a device (1 with
  no exchange: the pairs are the rows)."""
  if not cfg.num_experts:
    return 1.0
  with_mesh = expert_parallel.layout(cfg, tokens, expert_parallel.expert_input_name(cfg), mesh,
                                     ex.moe_capacity_factor)
  if with_mesh.ep == 1:
    return 1.0
  return min(1.0, with_mesh.n * cfg.num_experts_per_token / with_mesh.recv)


def grouped_rows_run(cfg, ex, mesh, tokens: int) -> float:
  """The share of the receive buffer's rows that the "megablox" grouped matmul computes (its
  grid stops at the group sizes, pallas_kernels/grouped_matmul/ops.py): the expected routed pairs,
  plus the row tiles that group boundaries share, at most one per local expert and one more
  for the last group's end (an upper bound). 1 with no exchange (the rows are the pairs)."""
  if not cfg.num_experts:
    return 1.0
  with_mesh = expert_parallel.layout(cfg, tokens, expert_parallel.expert_input_name(cfg), mesh,
                                     ex.moe_capacity_factor)
  if with_mesh.ep == 1:
    return 1.0
  tiles = cfg.num_experts // with_mesh.ep + 1
  return min(1.0, routed_fill(cfg, ex, mesh, tokens) + tiles * TILE / with_mesh.recv)


def dequantised_layer_bytes(params) -> int:
  """One MoE layer's packed routed experts as bf16 (2 bytes per weight; codes hold 2 per
  byte), this device's share: what a layer's matmuls dequantise at a time."""
  total = 0
  for path, x in _flat(params):
    if path[-1].endswith("_packed"):
      total += bytes_per_device(x) * 2 * 2 // x.shape[0]  # per layer of the [L, ...] stack
  return total


def _flat(tree):
  return [(tuple(str(getattr(k, "key", k)) for k in p), x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


BATCH_AXES = ("data", "fsdp", "expert", "context")  # a token's axes (context: its positions)


def train_comm_bytes(cfg, ex, mesh, params, trainable, rows_per_device: int, seq: int,
                     accum: int) -> float:
  """Bytes one device sends per train step, by hand (the compiled plan reads them from the
  program instead: comm.py), for ranking settings before any compile. Per micro-batch:
    weights     every weight split over a batch axis is all-gathered (compute width c) before
                use: forward, backward, and once more when full remat recomputes the forward;
                a device sends its shard to each of the f - 1 others. The routed experts only
                where their input width is split (layout.gather_axes); split over the experts
                they stay put and the tokens move;
    gradients   of `trainable`: reduce-scattered over the axes a weight is split on (fp32, its
                shard times f - 1) and all-reduced over the batch axes it is whole on
                (2 B (n - 1) / n);
    tokens      each MoE layer's routed pairs (rows x k of width h in c) out to their experts
                and back, (ep - 1) / ep of them leave the device: forward, backward, recompute;
    tensor      two all-reduces of the layer's [rows, seq, d] per layer and pass over tensor;
    context     (`seq` a device's positions of context x seq) each MLA layer all-gathers the
                row's latents (kv_lora + rope in c) and reduce-scatters their fp32 gradient.
  Every micro-batch pays the weights' and gradients' share again: more accumulation, more
  traffic."""
  sizes = dict(mesh.shape)
  c = 2 if ex.dtype == "bfloat16" else 4
  passes = 3 if ex.remat in (Remat.FULL, Remat.SAVE_ATTENTION) else 2
  in_name = expert_parallel.expert_input_name(cfg)
  tokens = rows_per_device * seq * math.prod(sizes[a] for a in BATCH_AXES)
  moe = expert_parallel.layout(cfg, tokens, in_name, mesh, ex.moe_capacity_factor) if (
      cfg.num_experts and cfg.moe_layers) else None
  size = lambda axes: math.prod(sizes[a] for a in axes)

  def split_axes(path, x) -> tuple[tuple[str, ...], tuple[str, ...]]:
    spec = x.sharding.spec if x.sharding is not None else ()
    used = tuple(a for entry in spec if entry is not None
                 for a in ((entry,) if isinstance(entry, str) else entry))
    if moe is not None and "experts" in path:
      return moe.gather_axes, tuple(a for a in BATCH_AXES if a not in used)
    return (tuple(a for a in used if a in BATCH_AXES),
            tuple(a for a in BATCH_AXES if a not in used))

  weights = grads = 0.0
  for path, x in _flat(params):
    gathered, _ = split_axes(path, x)
    width = 1 if x.dtype.itemsize == 1 else c  # packed MXFP4 codes and scales move as bytes
    weights += passes * bytes_per_device(x) / x.dtype.itemsize * width * (size(gathered) - 1)
  for path, x in _flat(trainable):
    split, whole = split_axes(path, x)
    shard = bytes_per_device(x) / x.dtype.itemsize * 4
    grads += shard * (size(split) - 1) + 2 * shard * (size(whole) - 1) / size(whole)
  routed = 0.0
  if moe is not None and moe.ep > 1:
    h = cfg.latent_size if in_name == "latent" else cfg.hidden_size
    rows = min(moe.recv, moe.n // size(moe.psum_axes) * cfg.num_experts_per_token)
    routed = len(cfg.moe_layers) * 2 * passes * rows * h * c * (moe.ep - 1) / moe.ep
  t = sizes.get("tensor", 1)
  tensor = (cfg.num_layers * 2 * passes * 2 * rows_per_device * seq * cfg.hidden_size * c
            * (t - 1) / t)
  n = sizes.get("context", 1)
  latent = (len(cfg.mla_layers) * rows_per_device * seq * n * (cfg.kv_lora_rank
            + cfg.qk_rope_head_dim) * ((passes - 1) * c + 4) * (n - 1) / n)
  return accum * (weights + grads + routed + tensor + latent)
