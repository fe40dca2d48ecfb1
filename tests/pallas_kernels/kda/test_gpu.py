"""GPU KDA kernels (Pallas, Triton lowering) in interpret mode vs the naive recurrence in float64,
and their lowering to Triton for a CUDA target on this CPU-only machine (docs/kernels.md,
docs/correctness.md; tolerances in tests/numerics.py).

K=32, V=64 are powers of two, as the Triton lowering needs (other sizes are zero-padded).
"""

import jax
import jax.numpy as jnp
import pytest

from tests import numerics
from tests.pallas_kernels.kda import kda_cases
from pallas_kernels.kda.gpu import kda_gpu
from pallas_kernels.kda.reference import naive_kda


def kernel(*args, **kw):
  return kda_gpu(*args, **kw, interpret=True)


@pytest.mark.parametrize("T", [1, 63, 64, 130])
def test_fp32_matches_naive(T):
  kda_cases.check_against_naive(kernel, B=2, T=T, H=2, K=32, V=64, decay="mild")


def test_fp32_strong_gate_matches_naive():
  kda_cases.check_against_naive(kernel, B=2, T=130, H=2, K=32, V=64, decay="k3", seed=3)


def test_bf16_matches_naive_on_same_inputs():
  kda_cases.check_against_naive(kernel, B=2, T=130, H=1, K=128, V=128, dtype=jnp.bfloat16,
                                seed=5)


def test_odd_feature_sizes_are_padded():
  q, k, v, g, beta, h0 = kda_cases.make_inputs(1, 40, 1, 24, 40, seed=7, decay="mild")
  o, ht = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  o_ref, ht_ref = numerics.float64_truth(
      lambda *a: naive_kda(*a[:5], initial_state=a[5], output_final_state=True),
      q, k, v, g, beta, h0)
  numerics.assert_close("o", o, o_ref)
  numerics.assert_close("final_state", ht, ht_ref)


def test_public_op_with_the_lower_bound_gate():
  """ops.kda hands K3's raw inputs to kda_gpu, which prepares them in its wrapper (the GPU
  kernels take prepared inputs); same as "naive"."""
  kda_cases.check_fused_against_naive(kda_cases.via_op("pallas_gpu"), B=2, T=63, H=2, K=32,
                                      V=64, reference=kda_cases.via_op("naive"))


def test_lowers_to_triton_for_cuda_forward_and_gradient():
  """Pallas -> Triton IR for an (abstract) H100, no GPU needed. Compiling that IR to a cubin
  happens inside XLA:GPU, which needs the CUDA PJRT plugin and a GPU: not checked here."""
  kernels = {"forward": ["kda_intra_fwd_gpu", "kda_fwd_gpu"],
             "gradient": ["kda_intra_fwd_gpu", "kda_fwd_gpu", "kda_bwd_gpu",
                          "kda_intra_bwd_gpu"]}
  for what, text in kda_cases.lower_for_h100(kda_gpu).items():
    assert "__gpu$xla.gpu.triton" in text
    for name in kernels[what]:
      assert name in text, name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_step_matches_naive(dtype):
  """Through the public decode op, so the dispatch to the fused kernel is covered too."""
  from pallas_kernels.kda import kda_step
  kda_cases.check_decode_steps(
      lambda *a: kda_step(*a, backend="pallas_gpu", interpret=True), dtype=dtype)
