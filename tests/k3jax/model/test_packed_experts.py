"""Routed experts held as MXFP4 codes at run time (k3jax/model/expert_weights.py): the grouped
matmuls take the codes and scales (pallas_kernels/mxfp4/ops.py), never a float copy of a
layer's stack, and compute what the dequantised model computes.

float64 throughout for the equalities: the packed product is the dequantise-then-multiply
reference bit for bit on XLA:CPU ("tiled", tests/pallas_kernels/mxfp4), so the packed model
equals the dense one up to the float sums that legitimately differ: the adapters' low-rank
path x W + (x A)(s B) against the merged x (W + s A B) (a few float64 ulps of the logits,
1e-10 leaves orders of magnitude) and the expert-parallel sums (test_expert_parallel.py's
bound).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from convert.hf_load import load_model
from k3jax.execution import Execution
from k3jax.model import expert_weights, lora
from k3jax.model.moe import MoE
from sharding.mesh import make_mesh
from sharding.placement import variable_spec
from tests.k3jax.model.helpers import F64, tiny_cfg
from tests.k3jax.model.test_expert_parallel import assert_same, make_moe, run

ATOL = 1e-10


def _random_adapters(model, seed=3):
  key = jax.random.key(seed)
  nnx.update(model, jax.tree.map(
      lambda x: 0.05 * jax.random.normal(jax.random.fold_in(key, x.size), x.shape, x.dtype),
      nnx.state(model, nnx.LoRAParam)))


@nnx.jit
def logits(model, ids):
  return model(ids).logits


@pytest.fixture(scope="module")
def tiny64(reference_dir):
  with jax.enable_x64(True):  # (float64 arrays; the tests enter x64 themselves to use them)
    return load_model(os.path.join(reference_dir, "k3_tiny_a"), F64)


@pytest.mark.parametrize("targets", [None, ("mla.*", "moe.experts.*")],
                         ids=["base", "expert_adapters"])
def test_packed_model_computes_the_dequantised_model(tiny64, reference_dir, targets):
  """k3_tiny_a (MXFP4 experts as released) with its experts packed, no QAT: the same logits
  as the float model (bit for bit without adapters), and with random adapters on MLA and every
  routed expert those of the merged model, W + s A B folded in float64."""
  model, _ = tiny64
  ids = np.load(os.path.join(reference_dir, "k3_tiny_a", "reference.npz"))["input_ids"][:, :24]
  with jax.enable_x64(True):
    spec = lora.AdaptSpec(rank=3 if targets else None, alpha=6.0, base_experts="mxfp4",
                          targets=targets or lora.DEFAULT_TARGETS)
    packed = lora.adapt(nnx.clone(model), spec, nnx.Rngs(1))
    ex = lora.expert_paths(packed)["moe.experts"]
    assert ex.operands("w1").packed and not hasattr(ex, "w1")
    if targets is None:
      np.testing.assert_array_equal(np.asarray(logits(packed, ids)),
                                    np.asarray(logits(model, ids)))
      return
    _random_adapters(packed)
    assert ex.operands("w2").lora_a is not None
    got = logits(packed, ids)
    want = logits(nnx.merge(nnx.graphdef(model), nnx.state(lora.merge(packed))), ids)
    assert float(jnp.max(jnp.abs(got - logits(model, ids)))) > 1.0  # the adapters count
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL)


def _packable_cfg(**overrides):
  """tiny_cfg with widths of whole MXFP4 groups (latent 32, F 64: two groups, one per tensor
  rank at tensor=2)."""
  return tiny_cfg(latent_size=32, moe_intermediate_size=64, **overrides)


def _pack(moe, adapters: bool):
  """The MoE with its experts packed (exact: their values are made MXFP4 first), and random
  adapters on w1, w3, w2; returns the dense twin holding the same (dequantised) weights."""
  ex = moe.experts
  names = {w: lora._names(getattr(ex, w)) for w in lora.EXPERT_WEIGHTS}
  for w in lora.EXPERT_WEIGHTS:
    getattr(ex, w).set_value(lora.mx.round_mxfp4(getattr(ex, w)[...]))
  dense = nnx.clone(moe)
  lora.pack_experts(ex, names)
  if adapters:
    for m in (moe, dense):
      for w in lora.EXPERT_WEIGHTS:
        lora._attach_expert(m.experts, w, names[w], lora.AdaptSpec(rank=3, alpha=6.0),
                            nnx.Rngs(2), moe.ex.jnp_param_dtype)
      _random_adapters(m)
  return dense


def test_adapter_gradients_through_the_packed_kernel(x64):
  """LoRA over a packed base differentiates through the packed product's custom_vjp (dx = dy
  W^T): the adapters' gradients equal those of the same adapters over the float base (merged
  weights, plain autodiff)."""
  cfg = _packable_cfg()
  moe = make_moe(cfg, ex=F64)
  dense = _pack(moe, adapters=True)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 5, cfg.hidden_size)))
  grad = nnx.jit(nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x)[0])),
                          argnums=nnx.DiffState(0, nnx.LoRAParam)))
  got, want = (nnx.to_flat_state(grad(m, x)) for m in (moe, dense))
  assert [p for p, _ in got] == [p for p, _ in want] and len(got) == 6
  for (path, a), (_, b) in zip(got, want):
    a, b = np.asarray(a[...]), np.asarray(b[...])
    assert np.abs(b).max() > 1e-3, path
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=str(path))


CASES = {  # mesh, overrides: the packed parts' placements and gathers
    # experts over expert x fsdp, F over tensor: each rank its own groups of w2's F (scales
    # split with them), and of w1 / w3's outputs
    "fsdp2_expert2_tensor2": ("fsdp=2,expert=2,tensor=2", {}),
    # 12 experts: latent over fsdp, the codes gathered per layer inside the shard_map
    "fsdp2_expert4_12_experts": ("fsdp=2,expert=4", {"num_experts": 12}),
}


@functools.cache
def _case(case, adapters):
  mesh_spec, overrides = CASES[case]
  with jax.enable_x64(True):
    moe = make_moe(_packable_cfg(**overrides), ex=F64)
    _pack(moe, adapters)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 5, moe.cfg.hidden_size)))
    return run(moe, x), run(moe, x, make_mesh(mesh_spec))


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "adapters"])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_packed_equals_one_device(case, adapters):
  """Forward, routing and every gradient (the adapters' included)."""
  one, ep = _case(case, adapters)
  assert_same(one, ep)


@pytest.mark.parametrize("tensor, f, split", [(2, 64, True), (4, 64, False), (2, 32, False)])
def test_w2_scales_split_over_tensor_with_their_codes(tensor, f, split):
  """At rest, w2's scales [E, l, F / 32] are split over `tensor` along F, as its codes are,
  when F's groups of 32 divide over it (one rank's scales are those of its own codes, which
  the packed matmul hands each rank anyway; at K3 the whole scales are 3.3 GiB a device on
  expert=8), and whole where they do not (a mesh the packed matmul then refuses when it
  runs). w1 / w3's scales stay whole along their input h."""
  moe = make_moe(tiny_cfg(latent_size=32, moe_intermediate_size=f), ex=Execution())
  lora.pack_experts(moe.experts, {w: lora._names(getattr(moe.experts, w))
                                  for w in lora.EXPERT_WEIGHTS})
  mesh = jax.sharding.AbstractMesh((2, tensor), ("expert", "tensor"))
  spec = lambda name: tuple(variable_spec(getattr(moe.experts, name), mesh))
  assert spec("w2_packed") == ("expert", None, "tensor")
  assert spec("w2_scale") == ("expert", None, "tensor" if split else None)
  assert spec("w1_packed") == ("expert", "tensor", None)
  assert spec("w1_scale") == ("expert", "tensor", None)


def _jaxpr_avals(jaxpr):
  """Every intermediate value of a (closed) jaxpr and its sub-jaxprs (loops, custom_vjp,
  shard_map, pjit...)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield v.aval
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):  # a Jaxpr or a ClosedJaxpr
          yield from _jaxpr_avals(sub)


def test_no_float_copy_of_a_layers_experts(monkeypatch):
  """The forward and input gradient of a MoE layer with packed experts hold no float array of
  a layer's stack [E, in, out] (its jaxpr, every sub-jaxpr included), and compiled, their
  temporaries are at least a stack's float32 bytes below the same layer run through the
  dequantise-then-multiply reference (which holds one)."""
  cfg = tiny_cfg(latent_size=256, moe_intermediate_size=512, num_experts=16)
  moe = MoE(cfg, Execution(moe_grouped_matmul="tiled"), rngs=nnx.Rngs(0))
  lora.pack_experts(moe.experts, {w: lora._names(getattr(moe.experts, w))
                                  for w in lora.EXPERT_WEIGHTS})
  e, l, f = cfg.num_experts, cfg.latent_size, cfg.moe_intermediate_size
  x = jnp.zeros((2, 8, cfg.hidden_size), jnp.float32)
  graphdef, state = nnx.split(moe)
  stacks = {(e, l, f), (e, f, l)}

  def traced():
    """(float stacks in the jaxpr, compiled temporaries) of the forward and input gradient;
    a new function each time (jax caches traces by function)."""
    def step(x, s):
      return jax.value_and_grad(lambda x: jnp.sum(nnx.merge(graphdef, s)(x)[0]))(x)
    held = [a for a in _jaxpr_avals(jax.make_jaxpr(step)(x, state))
            if getattr(a, "shape", None) in stacks and jnp.issubdtype(a.dtype, jnp.floating)]
    return held, jax.jit(step).lower(x, state).compile().memory_analysis().temp_size_in_bytes

  held, temp = traced()
  assert held == []
  monkeypatch.setitem(expert_weights.PACKED_IMPL, "tiled", "reference")
  held_ref, temp_ref = traced()
  assert held_ref  # (the check does see the reference's copies)
  stack = e * l * f * 4
  assert temp + stack <= temp_ref, (temp, temp_ref, stack)
  print(f"\ntemporaries: packed {temp / 2**20:.1f} MiB, dequantise-then-multiply "
        f"{temp_ref / 2**20:.1f} MiB (one stack {stack / 2**20:.1f} MiB)")


def test_megablox_config_expert_parallel_equals_one_device():
  """moe_grouped_matmul="megablox" (what `k3jax train` runs on TPU) takes packed experts to the
  Pallas MXFP4 kernel, which lowered for the CPU runs the tile loop (pallas_kernels/mxfp4/
  tpu.py): its platform switch and varying-type casts inside the expert-parallel body, float32,
  with adapters, against the one-device dense MoE in float64 on the same (dequantised)
  weights: forward, routing and every gradient. Tolerance and routing margin as
  test_expert_parallel.py's megablox test (its float32 bound, 0.015)."""
  mesh_spec, overrides = CASES["fsdp2_expert2_tensor2"]
  cfg32 = _packable_cfg(**overrides)
  moe32 = make_moe(cfg32, ex=Execution(moe_grouped_matmul="megablox"))
  dense32 = _pack(moe32, adapters=True)
  x32 = jnp.asarray(np.random.default_rng(1).standard_normal((8, 5, cfg32.hidden_size)),
                    jnp.float32)
  ep = run(moe32, x32, make_mesh(mesh_spec))
  with jax.enable_x64(True):
    graphdef, state = nnx.split(dense32)
    ex64 = F64
    dense64 = nnx.merge(graphdef, jax.tree.map(
        lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        state))
    for m in (dense64, dense64.experts, dense64.gate):
      m.ex = ex64
    for w in lora.EXPERT_WEIGHTS:  # frozen, as the packed codes are: no gradient to compare
      setattr(dense64.experts, w, nnx.Variable(getattr(dense64.experts, w)[...]))
    one = run(dense64, jnp.asarray(x32, jnp.float64))
    bias = np.asarray(dense64.gate.bias[...])
    biased = np.sort(np.asarray(one[1].scores_ne) + bias, axis=-1)[..., ::-1]
    k = cfg32.num_experts_per_token
    assert np.min(biased[..., k - 1] - biased[..., k]) > 1e-4
    assert_same(one, ep, atol=0.015)


def test_packed_expert_parallel_compiles_the_kernel_for_tpu():
  """The expert-parallel layer with packed experts and adapters, forward and backward under
  remat (as `k3jax train` runs its layers; remat's partial evaluation retraces the kernel's
  surroundings with shard_map's type check on), compiled for a v5e 2x2 topology (libtpu, no
  TPU needed; tensor-parallel F, so each rank its own groups): the program holds the MXFP4
  kernel both ways."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  mesh = make_mesh("expert=2,tensor=2", devices=topo.devices)
  cfg = tiny_cfg(latent_size=32, moe_intermediate_size=64)
  ex = Execution(dtype="bfloat16", param_dtype="bfloat16", moe_grouped_matmul="megablox")

  def build():
    moe = MoE(cfg, ex, rngs=nnx.Rngs(0))
    spec = lora.AdaptSpec(rank=4, targets=("experts.*",), base_experts="mxfp4")
    return lora.adapt(moe, spec, nnx.Rngs(1))

  graphdef, adapters, frozen = nnx.split(nnx.eval_shape(build), nnx.LoRAParam, ...)
  adapters, frozen = (jax.tree.map(
      lambda v: v.replace(jax.ShapeDtypeStruct(
          v.get_value().shape, v.get_value().dtype,
          sharding=NamedSharding(mesh, variable_spec(v, mesh)))),
      s, is_leaf=lambda v: isinstance(v, nnx.Variable)) for s in (adapters, frozen))
  x = jax.ShapeDtypeStruct((4, 16, cfg.hidden_size), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("expert")))

  @jax.checkpoint
  def layer(adapters, x, frozen):
    return nnx.merge(graphdef, adapters, frozen)(x)[0]

  def loss(adapters, x, frozen):  # the adapters' gradient and the input's (dx: W^T)
    return jnp.sum(layer(adapters, x, frozen).astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(adapters, x, frozen).lower(
        lowering_platforms=("tpu",)).compile().as_text()
  assert "mxfp4_grouped_matmul" in hlo and "mxfp4_grouped_matmul_t" in hlo
