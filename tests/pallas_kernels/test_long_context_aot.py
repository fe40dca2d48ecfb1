"""The per-shard kernels of a million-token context compile ahead of time for v5p at 131,072
positions per device, with memory linear in the positions (docs/kernels.md#long-sequences).

Per device of K3 at tensor=8 (12 heads), bf16, the gradient program (forward included) of:
- KDA's range on the Pallas TPU kernel (`ops.kda_range`: the V + K value columns context
  parallelism runs, raw inputs fused in-kernel, packed segments);
- flash attention over the device's whole sequence (MLA without context parallelism);
- flash attention over latents (`latent_attention`): the device's 131,072 queries, as the
  balanced split's two half-ranges, against the 1,048,576 gathered latents of context=8.
Each compiles at 65,536 and 131,072 positions: every memory figure XLA plans (arguments,
temporaries, outputs) doubles with the positions (O(T x d)), and the total stays below half of
one head's [T, T] scores and a quarter of one float32 K x V state per token (KDA keeps one per
chunk of 64). libtpu compiles; no TPU is needed. Minutes on a 2-core CPU: `long`.
"""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")
from jax.experimental import topologies

from pallas_kernels.flash_attention import flash_attention, latent_attention
from pallas_kernels.kda import ops
from pallas_kernels.kda.reference import RawInputs

pytestmark = pytest.mark.long

H, K, V = 12, 128, 128            # K3's KDA (and MLA) heads per device at tensor=8
T = 131072                        # positions per device
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
K3_RAW = RawInputs(gate="lower_bound", lower_bound=-5.0, use_qk_l2norm=True,
                   use_beta_sigmoid=True)


def _kda(t):
  def loss(q, k, v, g, beta, A_log, dt_bias, seg):
    r = ops.kda_range(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, raw=K3_RAW,
                      segment_ids=seg, backend="pallas_tpu")
    return (jnp.sum(r.o ** 2) + jnp.sum(r.read ** 2) + jnp.sum(r.offset)
            + jnp.sum(r.transition))
  shapes = [((1, t, H, K), BF), ((1, t, H, K), BF), ((1, t, H, V), BF), ((1, t, H, K), F32),
            ((1, t, H), F32), ((H,), F32), ((H, K), F32), ((1, t), I32)]
  return jax.grad(loss, argnums=tuple(range(7))), shapes, ("kda_fwd_tpu", "kda_bwd_tpu")


def _flash(t):
  def loss(q, k, v, seg):
    return jnp.sum(flash_attention(q, k, v, seg, scale=192**-0.5)[0].astype(F32) ** 2)
  shapes = [((1, t, H, 192), BF), ((1, t, H, 192), BF), ((1, t, H, 128), BF), ((1, t), I32)]
  return jax.grad(loss, argnums=(0, 1, 2)), shapes, ()


def _latent(t, context=8):
  # the balanced split's call: the device's queries as two half-ranges (starts traced), each
  # visiting its causal key blocks, 2 x context + 1 half-ranges of keys in all
  half = t // 2
  def loss(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts):
    o, _ = latent_attention(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts,
                            scale=192**-0.5, visits=(2 * context + 1) * half // 512)
    return jnp.sum(o.astype(F32) ** 2)
  tk = context * t
  shapes = [((1, t, H, 128), BF), ((1, t, H, 64), BF), ((1, tk, 512), BF), ((1, tk, 64), BF),
            ((512, H, 128), BF), ((512, H, 128), BF), ((1, t), I32), ((1, tk), I32),
            ((2,), I32)]
  return jax.grad(loss, argnums=tuple(range(6))), shapes, ()


def _memory(make, t):
  """(argument, temporary, output bytes) of the program compiled for one v5p device."""
  device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
  sharding = NamedSharding(jax.sharding.Mesh([device], ("x",)), P())
  fn, shapes, kernels = make(t)
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
  compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()
  text = compiled.as_text()
  assert all(name in text for name in kernels), kernels
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes


@pytest.mark.parametrize("make", [_kda, _flash, _latent], ids=["kda_range", "flash", "latent"])
def test_compiles_at_131072_positions_per_device_in_linear_memory(make):
  half, full = _memory(make, T // 2), _memory(make, T)
  print(f"\n{make.__name__}: args / temp / out MiB at {T}: "
        + " / ".join(f"{b / 2**20:.0f}" for b in full))
  for name, a, b in zip(("arguments", "temporaries", "outputs"), half, full):
    assert 1.9 * a <= b <= 2.1 * a, (name, a, b)   # linear in the positions
  total = sum(full)  # all heads' [T, T] scores, or one K x V state per token, would dwarf it:
  assert total < 2 * T * T / 2                      # half of one head's bf16 [T, T] scores
  assert total < 4 * T * H * K * V / 4              # a quarter of a float32 K x V per token
