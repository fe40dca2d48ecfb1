"""LoRA adapters, MXFP4-packed experts and expert QAT on the model (k3jax/model/lora.py), against
an independent reference: the same model with the adapters folded into float64 weights. (The
MXFP4 format itself, jnp against numpy bit for bit: tests/pallas_kernels/mxfp4/test_format.py.)"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert.hf_load import load_model
from k3jax.execution import Execution
from k3jax.model import lora


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


@pytest.mark.long
def test_adapter_gradients_through_the_full_remat_scan(x64):
  """LoRA differentiates only the adapters: the full-remat scan (block_scan, which builds
  gradient accumulators for differentiated stack leaves only) gives the adapters' gradients of
  the unrolled model without remat. float64 (summation order only, ~1e-16 here; a dropped or
  misplaced adapter gradient would differ by far more than 1e-10)."""
  from k3jax.model import schedule
  from k3jax.model.transformer import K3Model
  from tests.k3jax.model.helpers import F64, randomize, tiny_cfg
  cfg = tiny_cfg(num_layers=5, mla_layers=(4,), attn_res_block_size=2)
  assert any(r.scanned for r in schedule.runs(cfg, scan=True))
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
