"""Placement from the one rules table (docs/sharding.md): parameters of the real model tree,
optimizer moments beside their parameters, and an init that creates every array in its shards."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import configs
from k3jax.execution import Execution
from k3jax.model.transformer import K3Model
from k3jax.optim import param_labels
from k3jax.train import step as step_lib
from k3jax.train.loop import step_config
from sharding.activations import activation_spec
from sharding.mesh import make_mesh
from sharding.placement import variable_shardings
from tests.k3jax.train.helpers import options

from .helpers import TWO_LAYERS, model_config, run_options, step_cfg

MESH = "fsdp=2,expert=2,tensor=2"


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(MESH)


@pytest.fixture(scope="module")
def tiny_steps(mesh):
  return step_lib.build(TWO_LAYERS, Execution(), step_config(options("unused", "unused")), mesh)


def _key(k):
  return getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))


def flat(tree):
  return {tuple(_key(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_parameters_follow_the_table(mesh):
  abstract = nnx.eval_shape(lambda: K3Model(configs.get("tiny"), rngs=nnx.Rngs(0)))
  specs = {k: s.spec for k, s in flat(variable_shardings(nnx.state(abstract), mesh)).items()}
  want = {  # heads on tensor, experts on expert x fsdp, model width on fsdp; stacks whole
      ("kda", "q_proj", "kernel"): P(None, "fsdp", "tensor", None),
      ("kda", "o_proj", "kernel"): P(None, "tensor", None, "fsdp"),
      ("kda", "A_log"): P(None, "tensor"),
      # [rank, heads, dim]: the low rank on fsdp, heads on tensor
      ("mla", "q_b_proj", "kernel"): P(None, "fsdp", "tensor", None),
      ("mla", "k_b_proj", "kernel"): P(None, "fsdp", "tensor", None),
      ("mla", "q_a_proj", "kernel"): P(None, "fsdp", None),  # [embed, rank]: embed first
      # fsdp as more expert parallelism: the latent width stays whole, no weight moves
      ("moe", "experts", "w1"): P(None, ("expert", "fsdp"), None, "tensor"),
      ("moe", "experts", "w2"): P(None, ("expert", "fsdp"), "tensor", None),
      # [embed, latent]: each mesh axis once per array, by rule priority (embed first)
      ("moe", "routed_down", "kernel"): P(None, "fsdp", None),
      ("moe", "routed_up", "kernel"): P(None, None, "fsdp"),
      ("moe", "gate", "kernel"): P(None, "fsdp", None),
      ("moe", "gate", "bias"): P(None, None),
      ("embed",): P("tensor", "fsdp"),
      ("lm_head",): P("fsdp", "tensor"),
  }
  for path, spec in want.items():
    assert specs[path] == spec, (path, specs[path])
  assert len(specs) == len(jax.tree.leaves(nnx.state(abstract)))
  # 6 experts do not split over expert x fsdp = 4: the fallback row, experts on expert and
  # the latent width on fsdp
  six = nnx.eval_shape(lambda: K3Model(configs.get("tiny", num_experts=6), rngs=nnx.Rngs(0)))
  specs = {k: s.spec for k, s in flat(variable_shardings(nnx.state(six), mesh)).items()}
  assert specs["moe", "experts", "w1"] == P(None, "expert", "fsdp", "tensor")
  assert specs["moe", "experts", "w2"] == P(None, "expert", "tensor", "fsdp")
  # activations: rows over data x fsdp x expert (data has size 1 here), the model width
  # whole, vocab on tensor
  assert activation_spec(("batch", "length", "embed"), (8, 16, 128), mesh) == P(
      ("fsdp", "expert"), None, None)
  assert activation_spec(("batch", "length", "vocab"), (8, 16, 256), mesh) == P(
      ("fsdp", "expert"), None, "tensor")
  assert activation_spec(("batch", "length", "embed"), (2, 16, 128), mesh) == P(
      "fsdp", None, None)  # a 2-row batch: split as far as it divides


def test_k3_on_a_pod_mesh_holds_each_parameter_once():
  """K3 (2.78T parameters) on a 1024-device fsdp=512 x tensor=2 mesh: the parameters split
  1024 ways to within 1%, and every stack over 2^24 parameters at least over fsdp's 512 (a
  [embed, rank] down-projection has no second axis for tensor). Before the low-rank widths took
  fsdp, MLA's q_b/k_b/v_b and KDA's f_b stacks sat whole on every fsdp device: 2 GiB per fp32 copy
  each
  device, 20% over the even split."""
  abstract = nnx.eval_shape(lambda: K3Model(configs.get("k3"), rngs=nnx.Rngs(0)))
  mesh = jax.sharding.AbstractMesh((1, 512, 1, 2), ("data", "fsdp", "expert", "tensor"))
  state = nnx.state(abstract)
  shards = flat(variable_shardings(state, mesh))
  total = local = 0
  for path, x in flat(state).items():
    path = path[:-1] if path[-1] == "value" else path  # the Variable's payload
    n = int(np.prod(x.shape))
    local_n = int(np.prod(shards[path].shard_shape(x.shape)))
    if path == ("kda", "f_b_proj", "kernel"):
      # [69 layers, gate rank 128, 96 heads, 128]: only the heads split (tensor); 0.2 GiB fp32
      # a device, the one stack no mesh axis of this mesh divides further
      assert local_n * 2 == n, shards[path].spec
      continue
    total, local = total + n, local + local_n
    assert local_n * 512 <= n or n < 1 << 24, (path, x.shape, shards[path].spec)
  assert local * 1024 <= 1.01 * total, local * 1024 / total


def test_optimizer_state_lives_with_its_parameter(tiny_steps):
  """Per parameter: one Muon momentum (matrices) or AdamW's two moments (the rest), each
  placed exactly as the parameter; every other optimizer leaf is a replicated scalar."""
  params = flat(tiny_steps.shardings["params"])
  opt = flat(tiny_steps.shardings["opt_state"])
  labels = jax.tree.leaves(param_labels(tiny_steps.logical_axes))
  for (path, sharding), label in zip(params.items(), labels):
    mirrors = [s for p, s in opt.items() if p[-len(path):] == path]
    assert len(mirrors) == (1 if label == "muon" else 2), (path, label, len(mirrors))
    assert all(s == sharding for s in mirrors), path
  n_mirrors = sum(1 if label == "muon" else 2 for label in labels)
  rest = [s for p, s in opt.items()
          if not any(p[-len(q):] == q for q in params)]
  assert len(opt) == n_mirrors + len(rest)
  assert all(s.spec == P() for s in rest)


def test_init_creates_every_array_in_its_shards():
  """The float64 model of the train tests (its one-device init is the same compiled program
  as theirs): on the mesh every array comes out in its shards with the one-device values, and
  no device ever holds the whole model: the compiled init's per-device outputs + temporaries
  stay below the model's size."""
  opts = run_options("unused", "unused")
  with jax.enable_x64(True):
    (cfg, ex), sc = model_config(opts), step_cfg(opts)
    steps = step_lib.build(cfg, ex, sc, make_mesh(MESH))
    params, bias = steps.init_params(0)
    for tree, shardings in ((params, steps.shardings["params"]),
                            (bias, steps.shardings["router_bias"])):
      for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        assert a.sharding == s
    # the same random bits (partitionable RNG) through the same transforms compiled in other
    # fusions: equal up to a few ulps of float32, the dtype some initialisers draw in (conv
    # taps, A_log, dt_bias, as the official ones do)
    want = step_lib.build(cfg, ex, sc).init_params(0)
    for a, b in zip(jax.tree.leaves((params, bias)), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    stats = steps.init_params.lower(0).compile().memory_analysis()
  model_bytes = sum(a.nbytes for a in jax.tree.leaves((params, bias)))
  assert stats.output_size_in_bytes + stats.temp_size_in_bytes < model_bytes, stats


def test_restore_target_carries_the_shardings(tiny_steps):
  params, bias = jax.eval_shape(lambda: step_lib.init_params(TWO_LAYERS, Execution(), 0))
  target = step_lib.abstract_state(tiny_steps, params, bias)
  for leaf, sharding in zip(jax.tree.leaves(target), jax.tree.leaves(tiny_steps.shardings)):
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding == sharding
