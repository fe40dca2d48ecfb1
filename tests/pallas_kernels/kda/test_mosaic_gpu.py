"""Mosaic GPU KDA backend (docs/kernels.md, docs/correctness.md) on this CPU-only machine: the
kernel in Mosaic GPU interpret mode (plgpu.InterpretGPUParams: simulated TMA, shared memory,
barriers, wgmma as numpy matmuls) against the naive recurrence in float64, and its lowering for
CUDA, which runs Mosaic GPU's own lowering (wgmma operand layouts, TMA tile shapes, swizzles)
without a GPU. Tolerances in tests/numerics.py.

K=32, V=64 (K != V; K is zero-padded to 64 for the kernel's 64-wide tiles), and K=96, V=128
for the kernel's K-tile and V-block loops. Interpret mode
walks every (batch, head, V block, chunk) in Python, so shapes are tiny. The gradients run the
reverse-time Mosaic GPU kernel (mosaic_gpu_bwd) in interpret mode as well.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import ops
from pallas_kernels.kda.mosaic_gpu import kda_mosaic_gpu, kda_step_mosaic_gpu, tf32_split
from tests import numerics
from tests.pallas_kernels.kda import kda_cases


def kernel(*args, **kw):
  return kda_mosaic_gpu(*args, **kw, interpret=True)


@pytest.mark.parametrize("T", [1, 63, 64])
def test_fp32_matches_naive(T):
  kda_cases.check_against_naive(kernel, B=2, T=T, H=1, K=32, V=64, decay="mild")


def test_fp32_three_chunks_k3_gate_two_k_tiles_two_v_blocks_matches_naive():
  """T = 130 (three chunks, the last one partial) with K3-strength decays; K = 96 walks two
  64-wide K tiles (zero-padded) and V = 128 runs two V-block programs."""
  kda_cases.check_against_naive(kernel, B=2, T=130, H=1, K=96, V=128, decay="k3", seed=3)


def test_bf16_matches_naive_on_same_inputs():
  kda_cases.check_against_naive(kernel, B=2, T=64, H=1, K=64, V=64, dtype=jnp.bfloat16,
                                seed=5)


def test_public_op_with_the_lower_bound_gate():
  """ops.kda hands K3's raw inputs to the backend, which prepares them before the kernel."""
  kda_cases.check_fused_against_naive(kda_cases.via_op("pallas_mosaic_gpu"), B=2, T=63, H=1,
                                      K=32, V=64, reference=kda_cases.via_op("naive"))


def test_tf32_split_is_exact_and_tf32_representable():
  x = jax.random.normal(jax.random.key(0), (4096,)) * jnp.exp2(
      jax.random.randint(jax.random.key(1), (4096,), -40, 40).astype(jnp.float32))
  hi, lo = tf32_split(x)
  np.testing.assert_array_equal(hi + lo, x)  # exact: lo is the float32 remainder
  bits = np.asarray(jax.lax.bitcast_convert_type(hi, jnp.uint32))
  assert not (bits & 0x1FFF).any()  # hi has TF32's 10 mantissa bits only
  assert (np.abs(lo) <= np.abs(x) * 2.0**-10).all()


def test_lowers_for_cuda_forward_and_gradient():
  """Pallas -> Mosaic GPU for an (abstract) H100, no GPU needed: the custom call carries the
  kernel's Mosaic GPU module. Compiling it to a cubin needs the CUDA plugin and a GPU."""
  texts = kda_cases.lower_for_h100(kda_mosaic_gpu)
  for text in texts.values():
    assert "@mosaic_gpu_v2" in text and "kda_fwd_mosaic_gpu" in text
  assert "kda_bwd_mosaic_gpu" not in texts["forward"]
  assert "kda_bwd_mosaic_gpu" in texts["gradient"]


def test_dispatch_picks_mosaic_gpu_on_sm90_and_newer(monkeypatch):
  assert [ops.gpu_backend(cc) for cc in ("7.0", "8.0", "8.9", "9.0", "10.0", None)] == [
      "pallas_gpu", "pallas_gpu", "pallas_gpu", "pallas_mosaic_gpu", "pallas_mosaic_gpu",
      "pallas_gpu"]

  class FakeGPU:
    def __init__(self, cc):
      self.compute_capability = cc

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  for cc, want in (("9.0", "pallas_mosaic_gpu"), ("8.0", "pallas_gpu")):
    monkeypatch.setattr(jax, "devices", lambda cc=cc: [FakeGPU(cc)])
    assert ops.default_backend() == want
    assert ops._resolve(None, "kda", K=128)[0] == want
  # K beyond the kernel's shared memory plan, or no Mosaic GPU module: the Triton kernels.
  monkeypatch.setattr(jax, "devices", lambda: [FakeGPU("9.0")])
  assert ops._resolve(None, "kda", K=256)[0] == "pallas_gpu"
  assert ops._resolve(None, "kda_step")[1] is kda_step_mosaic_gpu
  monkeypatch.setitem(__import__("sys").modules, "pallas_kernels.kda.mosaic_gpu", None)
  assert ops._resolve(None, "kda", K=128)[0] == "pallas_gpu"



def test_decode_step_matches_naive():
  """Through the public decode op, so the dispatch to the fused kernel is covered too."""
  from pallas_kernels.kda import kda_step
  kda_cases.check_decode_steps(
      lambda *a: kda_step(*a, backend="pallas_mosaic_gpu", interpret=True))


def test_decode_step_lowers_for_cuda():
  B, H, K = 8, 4, 128
  sds = jax.ShapeDtypeStruct
  args = [sds((B, H, K), jnp.bfloat16)] * 3 + [sds((B, H, K), jnp.float32),
                                               sds((B, H), jnp.float32),
                                               sds((B, H, K, K), jnp.float32)]
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(kda_step_mosaic_gpu).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "@mosaic_gpu_v2" in text and "kda_step_mosaic_gpu" in text


def _scan_recurrence(wn, qd, m, klT, uT, a, h0T):
  """The recurrence the kernels compute, as a plain jnp scan over chunks (transposed states):
  Vp^T = U^T + S0^T Wn^T, o^T = S0^T Qd^T + Vp^T M^T, S1^T = S0^T Diag(a) + Vp^T Kl."""
  def chunk(sT, x):
    wn, qd, m, klT, uT, a = x
    vpT = uT + sT @ wn.T
    return sT * a + vpT @ klT.T, sT @ qd.T + vpT @ m.T

  def one(wn, qd, m, klT, uT, a, h0T):
    htT, oT = jax.lax.scan(chunk, h0T, (wn, qd, m, klT, uT, a))
    return oT, htT

  for _ in range(2):
    one = jax.vmap(one)
  return one(wn, qd, m, klT, uT, a, h0T)


def test_recurrence_vjp_matches_a_float64_scan():
  """The recurrence's own VJP (reverse-time kernel + chunk-parallel gradients) against JAX's
  autodiff of a float64 scan, on operands of the prologue's shapes and sizes but otherwise
  arbitrary: 3 chunks, K = V = 128 (two K tiles, two V blocks). Tolerance docs/correctness.md's (the
  kernel's products are 3xTF32, < 2^-20 relative each, well inside 1e-5)."""
  from pallas_kernels.kda.mosaic_gpu import recurrence
  B, H, NT, C, K, V = 1, 1, 3, 64, 128, 128
  ks = jax.random.split(jax.random.key(7), 9)
  n = lambda i, *s: jax.random.normal(ks[i], (B, H, NT) + s) / np.sqrt(s[-1])
  operands = (n(0, C, K), n(1, C, K), jnp.tril(n(2, C, C)), n(3, K, C), n(4, V, C),
              jax.random.uniform(ks[5], (B, H, NT, K), minval=0.5, maxval=1.0),
              jax.random.normal(ks[6], (B, H, V, K)))
  cot = (jax.random.normal(ks[7], (B, H, NT, V, C)), jax.random.normal(ks[8], (B, H, V, K)))
  out, pull = jax.vjp(lambda *x: recurrence(*x, True), *operands)
  got = (out, pull(cot))
  want = numerics.float64_truth(
      lambda ops, cot: (lambda o, p: (o, p(cot)))(*jax.vjp(_scan_recurrence, *ops)),
      operands, cot)
  names = ("oT", "htT", "dwn", "dqd", "dm", "dklT", "duT", "da", "dh0T")
  for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.abs(w).max() > 1e-2, name
    numerics.assert_close(name, g, w)
