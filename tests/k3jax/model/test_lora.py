"""LoRA adapters, MXFP4-packed experts and expert QAT on the model (k3jax/model/lora.py,
pallas_kernels/mxfp4/format.py), against independent references: pallas_kernels/mxfp4/format.py's numpy quantiser
(bit for bit) and the same model with the adapters folded into float64 weights."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert.hf_load import load_model
from k3jax.execution import Execution
from k3jax.model import lora
from pallas_kernels import mxfp4 as mx


def tricky_weights(dtype, seed=0):
  """[in=128, out=24]: random groups over many binades, all-zero groups, -0, and values
  exactly on the E2M1 midpoints (ties) and past the saturation point."""
  rng = np.random.default_rng(seed)
  binade = np.repeat(rng.integers(-20, 20, (24, 4)), 32, axis=1)  # one per group of 32
  w = rng.standard_normal((24, 128)) * np.exp2(binade)
  w[0, :32] = 0.0
  w[1, :32] = -0.0
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  w[2, :32] = np.concatenate([mids, -mids, [6.0, -6.0, 4.0], rng.uniform(-6, 6, 15)])
  w[3, :32] = w[2, :32] * 2.0 ** -30
  w[4, 32:64] = np.concatenate([[7.99], rng.uniform(-7.99, 7.99, 31)])  # amax just under 8
  return w.T.astype(dtype)  # k3jax layout [in, out]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_jax_mxfp4_matches_the_numpy_quantiser_bit_for_bit(dtype):
  with jax.enable_x64(dtype == np.float64):
    w_io = tricky_weights(dtype)
    codes, scales = mx.quantize_np(w_io.T)
    got_codes, got_scales = jax.jit(mx.quantize)(jnp.asarray(w_io))
    np.testing.assert_array_equal(np.asarray(got_codes), codes)
    np.testing.assert_array_equal(np.asarray(got_scales), scales)
    truth = mx.dequantize_np(codes, scales, np.float64).T
    rounded = np.asarray(jax.jit(mx.round_mxfp4)(jnp.asarray(w_io)), np.float64)
    np.testing.assert_array_equal(rounded, truth)
    np.testing.assert_array_equal(np.signbit(rounded), np.signbit(truth))  # -0 kept
    deq = np.asarray(mx.dequantize(jnp.asarray(codes), jnp.asarray(scales), dtype), np.float64)
    np.testing.assert_array_equal(deq, truth)
    # straight-through: the gradient of sum(c * round(w)) is c
    c = jnp.asarray(np.arange(w_io.size, dtype=dtype).reshape(w_io.shape))
    g = jax.grad(lambda w: jnp.sum(c * mx.round_mxfp4(w)))(jnp.asarray(w_io))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))




@pytest.fixture(scope="module")
def tiny64(reference_dir):
  with jax.enable_x64(True):
    yield load_model(os.path.join(reference_dir, "k3_tiny_a"),
                     Execution(dtype="float64", param_dtype="float64"))


@nnx.jit
def logits(model, ids):
  return model(ids).logits


def test_adapters_compute_what_their_merged_weights_compute(tiny64, reference_dir):
  """Zero-initialised B leaves the model's logits exactly as they were (packing the released
  MXFP4 experts and rounding them again is exact too); random adapters on every projection
  and routed expert give the logits of the model with W + scale B A in float64 (summation
  order only: ~1e-13 on logits of size ~10)."""
  model, cfg = tiny64
  ids = np.load(os.path.join(reference_dir, "k3_tiny_a", "reference.npz"))["input_ids"][:, :24]
  with jax.enable_x64(True):
    base = logits(model, ids)
    adapted = nnx.clone(model)
    spec = lora.AdaptSpec(rank=3, alpha=6.0, targets=("*",), base_experts="mxfp4", qat=True)
    lora.adapt(adapted, spec, nnx.Rngs(1))
    assert float(jnp.max(jnp.abs(logits(adapted, ids) - base))) == 0.0
    chosen, experts = lora.matching(spec, adapted)
    assert len(experts) == 3 and "mla.q_b_proj" in chosen and "moe.routed_down" in chosen
    key = jax.random.key(3)
    state = nnx.state(adapted, nnx.LoRAParam)
    state = jax.tree.map(lambda x: 0.05 * jax.random.normal(jax.random.fold_in(key, x.size),
                                                             x.shape, x.dtype), state)
    nnx.update(adapted, state)
    got = logits(adapted, ids)
    # the merged model in the base's graph (one compiled forward for both)
    want = logits(nnx.merge(nnx.graphdef(model), nnx.state(lora.merge(adapted))), ids)
    assert float(jnp.max(jnp.abs(got - base))) > 1.0  # the adapters do change the model
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-10)
    # a pattern matching nothing is refused by name
    with pytest.raises(ValueError, match="'mla.nope' matches no projection"):
      lora.matching(lora.AdaptSpec(rank=2, targets=("mla.nope",)), adapted)


def test_adapter_gradients_through_the_full_remat_scan(x64):
  """LoRA differentiates only the adapters: the full-remat scan (block_scan, which builds
  gradient accumulators for differentiated stack leaves only) gives the adapters' gradients of
  the unrolled model without remat. float64 (summation order only, ~1e-16 here; a dropped or
  misplaced adapter gradient would differ by far more than 1e-10)."""
  from k3jax.model import schedule  # noqa: PLC0415
  from k3jax.model.transformer import K3Model  # noqa: PLC0415
  from tests.k3jax.model.helpers import F64, randomize, tiny_cfg  # noqa: PLC0415
  cfg = tiny_cfg(num_layers=5, mla_layers=(4,), attn_res_block_size=2)
  assert any(r.scanned for r in schedule.plan(cfg, scan=True))
  m = randomize(K3Model(cfg, F64, rngs=nnx.Rngs(1)))
  lora.adapt(m, lora.AdaptSpec(rank=3, alpha=6.0, targets=("*",)), nnx.Rngs(1))
  key = jax.random.key(3)
  nnx.update(m, jax.tree.map(lambda x: 0.05 * jax.random.normal(jax.random.fold_in(key, x.size),
                                                                 x.shape, x.dtype),
                             nnx.state(m, nnx.LoRAParam)))
  ids = jax.random.randint(jax.random.key(4), (2, 9), 0, cfg.vocab_size)
  grad_fn = nnx.jit(nnx.grad(lambda m: jnp.mean(m(ids).logits ** 2),
                             argnums=nnx.DiffState(0, nnx.LoRAParam)))
  m.ex = F64.replace(scan_layers=False)
  g_plain = nnx.to_flat_state(grad_fn(m))
  m.ex = F64.replace(remat="full")
  g_scan = nnx.to_flat_state(grad_fn(m))
  assert len(g_plain) == len(g_scan) > 0
  for (p, a), (_, b) in zip(g_plain, g_scan):
    a, b = np.asarray(a[...]), np.asarray(b[...])
    np.testing.assert_allclose(a, b, atol=1e-10 * max(1.0, np.abs(a).max()), rtol=0,
                               err_msg=str(p))
