"""Model FLOPs of a train step, and a measured matmul peak, for MFU.

What is counted, per token, forward (a multiply-add is 2 FLOPs):
  matmul       2 x active matmul parameters: every weight that multiplies activations (the
               projections of KDA / MLA / MLPs, router, latent down/up, shared experts, lm_head)
               with routed experts counted k/E of the time. The embedding table is a lookup,
               not a matmul, and is not counted (unless tied to the head); nor are norm gains,
               conv taps, A_log, dt_bias (elementwise).
  mla_attention  per MLA layer 2 * H * (d_qk + d_v) * (T+1)/2: scores and probs @ V over the
               causal half of a row of T positions (what causal attention needs; the masked
               upper half a dense implementation also computes is not counted).
  kda_core     per KDA layer and head, the chunked algorithm (chunk C = 64, docs/kernels.md):
               6 K V (inter-chunk: W S, (Q e^G) S, state update) + C (3 K + 2 V) (the lower-
               triangular A_kk, A_qk, T e^G K, T V and A_qk V' products, each half of C^2) +
               C^2 / 3 (the triangular solve).
  attn_res     per AttnRes read with n candidates 4 n d (scores and the weighted sum); a layer
               reads twice, the output once.
Train step = 3 x forward (backward = 2 x forward). Rematerialisation recomputes the forward but
is not model FLOPs (MFU convention, PaLM appendix B), so it is not counted.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.chips import device_chip
from k3jax.config import ModelConfig
from k3jax.model.transformer import K3Model
from k3jax.optim.groups import block_shape, dimension_numbers, logical_axes_from_state
from pallas_kernels.kda import flops_per_token as kda_flops_per_token


@dataclasses.dataclass(frozen=True)
class FlopCount:
  """Forward FLOPs per token by part (see module docstring)."""
  matmul: float
  mla_attention: float
  kda_core: float
  attn_res: float
  active_matmul_params: int

  @property
  def forward_per_token(self) -> float:
    return self.matmul + self.mla_attention + self.kda_core + self.attn_res

  @property
  def train_per_token(self) -> float:
    return 3.0 * self.forward_per_token


def active_matmul_params(cfg: ModelConfig) -> int:
  """Weights that multiply activations, routed experts counted k/E (from the real model's
  parameter tree, abstractly: nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  names = jax.tree.leaves(logical_axes_from_state(params), is_leaf=lambda x: isinstance(x, tuple))
  shapes = [v.shape for v in jax.tree.leaves(params)]
  total = 0.0
  for n, shape in zip(names, shapes):
    head = "vocab" in n and (n[0] == "embed" or cfg.tie_word_embeddings)  # lm_head [d, V]
    if dimension_numbers(n) is None and not head:
      continue
    size = math.prod(shape)
    if "experts" in n:
      size = size * cfg.num_experts_per_token / cfg.num_experts
    total += size
  return int(total)


def count(cfg: ModelConfig, seq_len: int) -> FlopCount:
  d = cfg.hidden_size
  n_mla, n_kda = len(cfg.mla_layers), len(cfg.kda_layers)
  ctx = (seq_len + 1) / 2
  mla = n_mla * 2 * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * ctx
  k = v = cfg.kda_head_dim
  kda = n_kda * cfg.kda_num_heads * kda_flops_per_token(k, v)
  attn_res = 0.0
  if cfg.attn_res_block_size is not None:
    s = cfg.attn_res_block_size
    for l in range(cfg.num_layers):
      sealed_before = (l - 1) // s + 1 if l > 0 else 0  # blocks sealed before layer l
      sealed_after = l // s + 1                         # ... and after its seal
      attn_res += 4 * d * (sealed_before + 1 if l else 0)  # the attention read (none at l=0)
      attn_res += 4 * d * (sealed_after + 1)             # the MLP read
    attn_res += 4 * d * ((cfg.num_layers - 1) // s + 2)  # the output read
  params = active_matmul_params(cfg)
  return FlopCount(matmul=2.0 * params, mla_attention=mla, kda_core=kda, attn_res=attn_res,
                   active_matmul_params=params)


def decode_per_token(cfg: ModelConfig, context: int) -> float:
  """Forward FLOPs of one new token that attends to `context` positions (a decode step of one
  row): `count`'s terms with MLA over the whole context rather than a training sequence's
  average of (T + 1) / 2, which `count` at length 2 * context - 1 is."""
  return count(cfg, 2 * context - 1).forward_per_token


def newton_schulz_flops(cfg: ModelConfig, steps: int = 5) -> float:
  """FLOPs of one Per-Head Muon update: Newton-Schulz over every block of every Muon-grouped
  parameter (from the real model's tree, abstractly). A block [m, n] (m <= n: tall blocks are
  transposed) costs per iteration A = X X^T (2 m^2 n), A A (2 m^3), (b A + c A A) X (2 m^2 n):
  4 m^2 n + 2 m^3. Once per optimizer step, whatever the batch; AdamW and the elementwise
  parts of the update are not counted."""
  abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  names = jax.tree.leaves(logical_axes_from_state(params), is_leaf=lambda x: isinstance(x, tuple))
  total = 0.0
  for n, v in zip(names, jax.tree.leaves(params)):
    dn = dimension_numbers(n)
    if dn is None:
      continue
    blocks, fan_in, fan_out = block_shape(tuple(v.shape), dn)
    m, k = sorted((fan_in, fan_out))
    total += blocks * steps * (4.0 * m * m * k + 2.0 * m**3)
  return total


def measure_matmul_peak(dtype=jnp.float32, n: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of the best of `repeats` [n, n] @ [n, n] products on the default device: the
  practical dense-matmul peak MFU is measured against (a chain of 4 per call amortises the
  dispatch)."""
  key = jax.random.key(0)
  a = jax.random.normal(key, (n, n), dtype)
  b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype) / n**0.5

  @jax.jit
  def chain(x):
    for _ in range(4):
      x = jnp.dot(x, b, preferred_element_type=dtype)
    return x

  chain(a).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    chain(a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 4 * 2 * n**3 / best


class PeakSource(enum.StrEnum):
  """Where the peak an MFU divides by comes from (`peak_source` in a run's summary)."""
  CHIP = "chip"          # the chip table's dense bf16 peak (k3jax/chips.py)
  FLAG = "flag"          # --peak-tflops
  MEASURED = "measured"  # measure_matmul_peak on this device (a CPU, a chip not in the table)


def device_peak(peak_tflops: float | None, dtype) -> tuple[float, PeakSource]:
  """(peak FLOP/s of one device, where it comes from): --peak-tflops when given, else the
  chip table's figure for the default device's kind, else a measured matmul peak."""
  if peak_tflops:
    return peak_tflops * 1e12, PeakSource.FLAG
  chip = device_chip(jax.devices()[0].device_kind)
  if chip is not None:
    return chip.peak_flops, PeakSource.CHIP
  return measure_matmul_peak(dtype), PeakSource.MEASURED
