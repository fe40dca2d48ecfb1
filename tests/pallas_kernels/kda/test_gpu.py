"""GPU KDA kernels (Pallas, Triton lowering) in interpret mode vs the naive recurrence in float64,
and their lowering to Triton for a CUDA target on this CPU-only machine (docs/kernels.md,
docs/correctness.md; tolerances in tests/numerics.py).

The checks shared with the TPU kernels are kda_cases.PallasChecks (TestCommon). K=32, V=64 are
powers of two, as the Triton lowering needs (other sizes are zero-padded).
"""

import functools

from pallas_kernels.kda.gpu import kda_gpu
from pallas_kernels.kda.reference import naive_kda
from tests import numerics
from tests.pallas_kernels.kda import kda_cases

kernel = functools.partial(kda_gpu, interpret=True)


class TestCommon(kda_cases.PallasChecks):
  backend, kernel = "pallas_gpu", staticmethod(kernel)


def test_odd_feature_sizes_are_padded():
  q, k, v, g, beta, h0 = kda_cases.make_inputs(1, 40, 1, 24, 40, seed=7, decay="mild")
  o, ht = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  o_ref, ht_ref = numerics.float64_truth(
      lambda *a: naive_kda(*a[:5], initial_state=a[5], output_final_state=True),
      q, k, v, g, beta, h0)
  numerics.assert_close("o", o, o_ref)
  numerics.assert_close("final_state", ht, ht_ref)


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
