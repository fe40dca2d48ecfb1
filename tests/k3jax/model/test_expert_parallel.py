"""Expert-parallel MoE (k3jax/model/expert_parallel.py) against the one-device MoE, on 8 fake CPU
devices (docs/sharding.md, docs/correctness.md): forward, routing and every parameter gradient, on
meshes that use each axis; the capacity factor's drops against a numpy count; the collectives of the
compiled program; the ragged path's offsets (through an emulation of ragged_all_to_all, which
XLA:CPU lacks) and its compilation for a TPU topology.

Both sides run in float64 and compute the same products; they differ only in the order of
float sums: token gradients summed per device then across devices, the tensor-parallel psum
of F partial sums, matmul blocking. Reordering a sum of n terms moves it by at most
n * u * sum|terms| (u = 2^-53); here n <= 160 (the largest reduction: 40 tokens x 3 slots
into an expert gradient, or 4 micro-sums) and sum|terms| <= 160 * 10 (|terms| stay below 10
with these weights), so |diff| <= 160 * 1.1e-16 * 1600 = 2.8e-11 < ATOL. A misrouted or
dropped row moves results by O(0.1).
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.execution import Execution
from k3jax.model import expert_parallel
from k3jax.model.moe import MoE
from sharding.activations import activation_spec
from sharding.mesh import make_mesh
from sharding.placement import variable_spec
from tests.k3jax.model.helpers import F64, kimi_linear_cfg, np64, randomize, tiny_cfg
from tests.k3jax.model.test_moe import np_moe

ATOL = 1e-10
COLLECTIVE = re.compile(r"= (\S+|\(.*?\)) (all-to-all|ragged-all-to-all|all-gather|all-reduce|"
                        r"reduce-scatter|collective-permute)(?:-start)?\(")


def spec_of(var, mesh):
  return variable_spec(var, mesh)  # the train step's placement (names and shape)


def placed(state, mesh):
  """The state with every variable placed by the rules table."""
  return jax.tree.map(
      lambda v: v.replace(jax.device_put(v.get_value(), NamedSharding(mesh, spec_of(v, mesh)))),
      state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def make_moe(cfg, seed=0, bias=None, ex=Execution()):
  moe = randomize(MoE(cfg, ex, rngs=nnx.Rngs(seed)), seed)
  rng = np.random.default_rng(seed + 100)
  b = rng.uniform(-0.1, 0.1, cfg.num_experts) if bias is None else bias
  moe.gate.bias.set_value(jnp.asarray(b, jnp.float32))
  return moe


def loss(m, x):
  y, r = m(x)
  return jnp.sum(jnp.sin(y)), (y, r)


grad_fn = nnx.value_and_grad(loss, has_aux=True)


def run(moe, x, mesh=None, grads=True):
  """(y, routing, grads or None, compiled program text or None); sharded over `mesh` when
  given."""
  graphdef, state = nnx.split(moe)

  def fwd_bwd(state, x):
    if not grads:
      return *nnx.merge(graphdef, state)(x), None
    (_, (y, r)), g = grad_fn(nnx.merge(graphdef, state), x)
    return y, r, g

  if mesh is None:
    return (*jax.jit(fwd_bwd)(state, x), None)
  state = placed(state, mesh)
  x = jax.device_put(x, NamedSharding(mesh, activation_spec(("batch", None, None), x.shape,
                                                            mesh)))
  with jax.set_mesh(mesh):
    compiled = jax.jit(fwd_bwd).lower(state, x).compile()
    return (*compiled(state, x), compiled.as_text())


def assert_same(a, b, atol=ATOL):
  y1, r1, g1, _ = a
  y2, r2, g2, _ = b
  np.testing.assert_array_equal(np.asarray(r1.experts_nk), np.asarray(r2.experts_nk))
  np.testing.assert_allclose(np64(r1.weights_nk), np64(r2.weights_nk), atol=atol, rtol=0)
  np.testing.assert_allclose(np64(y1), np64(y2), atol=atol, rtol=0)
  assert int(r1.dropped_pairs) == int(r2.dropped_pairs)
  flat1, flat2 = nnx.to_flat_state(g1), nnx.to_flat_state(g2)
  assert [p for p, _ in flat1] == [p for p, _ in flat2]
  for (path, v1), (_, v2) in zip(flat1, flat2):
    np.testing.assert_allclose(np64(v1.get_value()), np64(v2.get_value()), atol=atol, rtol=0,
                               err_msg=str(path))


def collectives(hlo: str) -> list[tuple[str, str, str]]:
  """(op, result type, source op) of every collective in a compiled program."""
  out = []
  for line in hlo.splitlines():
    if m := COLLECTIVE.search(line):
      src = re.search(r'op_name="([^"]*)"', line)
      out.append((m.group(2), m.group(1), src.group(1) if src else ""))
  return out


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all as its docstring defines it (one slice per peer), built from
  all_to_all so that XLA:CPU runs it: checks the offsets the ragged path computes."""
  ep, rows = input_offsets.shape[0], operand.shape[0]
  i = jnp.arange(rows)
  chunks = jnp.stack([jnp.where((i < send_sizes[j])[:, None],
                                jnp.roll(operand, -input_offsets[j], axis=0), 0)
                      for j in range(ep)])
  got = jax.lax.all_to_all(chunks, axis_name, 0, 0)            # got[s]: device s's slice
  where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  r = jnp.arange(output.shape[0])
  for s in range(ep):
    inside = (r >= where[s]) & (r < where[s] + recv_sizes[s])
    output = jnp.where(inside[:, None], got[s][jnp.clip(r - where[s], 0, rows - 1)], output)
  return output


@pytest.fixture
def ragged_on_cpu(monkeypatch):
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)


CASES = {  # mesh, model, dispatch (None: by platform, the padded all_to_all on CPU), overrides
    "expert8": ("expert=8", "k3", None, {}),
    "kimi_linear_data2_expert2_tensor2": ("data=2,expert=2,tensor=2", "kimi_linear", None, {}),
    # 12 experts do not split over expert x fsdp = 8: experts on expert, latent on fsdp (the
    # table's fallback row: FSDP gathers of the local experts inside the layer)
    "fsdp2_expert4_12_experts": ("fsdp=2,expert=4", "k3", None, {"num_experts": 12}),
    # 8 experts over expert x fsdp = 4 (2 per device), F over tensor
    "ragged_emulated_fsdp2_expert2_tensor2": ("fsdp=2,expert=2,tensor=2", "k3", "ragged", {}),
}


@functools.cache
def case_runs(case):
  """(one-device run, expert-parallel run) in float64; cached: the HLO test reads them too."""
  mesh_spec, model, dispatch, overrides = CASES[case]
  with jax.enable_x64(True), pytest.MonkeyPatch.context() as patch:
    if dispatch == "ragged":
      patch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    make = tiny_cfg if model == "k3" else kimi_linear_cfg
    cfg = make(**overrides)
    moe = make_moe(cfg, ex=F64.replace(moe_dispatch=dispatch))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 5, cfg.hidden_size)))
    return run(moe, x), run(moe, x, make_mesh(mesh_spec))


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_one_device(case):
  one, ep = case_runs(case)
  assert_same(one, ep)
  ops = collectives(ep[3])
  assert any(op == "all-to-all" and "shard_map" in src for op, _, src in ops), ops


def _np_kept(experts_nk, n_experts, cap, groups):
  """numpy: keep[n, j] for the first `cap` pairs of each expert in token order, per group of
  consecutive tokens (an exchange group's devices hold consecutive blocks of the batch)."""
  keep = np.zeros(experts_nk.shape, bool)
  for tokens in np.split(np.arange(experts_nk.shape[0]), groups):
    seen = np.zeros(n_experts, int)
    for n in tokens:
      for j, e in enumerate(experts_nk[n]):
        keep[n, j] = seen[e] < cap
        seen[e] += 1
  return keep


@pytest.mark.parametrize("dispatch", ["padded", "ragged"])
def test_capacity_factor_drops_exactly_the_overflow(dispatch, x64, request):
  """data=2 x expert=4: two exchange groups of 20 tokens, cap = ceil(1.0 * 3 * 20 / 8) = 8
  pairs per expert and group; a bias that draws most tokens to experts 0 and 1 overflows
  them. Dropped count and output against numpy."""
  if dispatch == "ragged":
    request.getfixturevalue("ragged_on_cpu")
  cfg = tiny_cfg()
  bias = np.zeros(cfg.num_experts)
  bias[:2] = 0.3
  moe = make_moe(cfg, bias=bias, ex=F64.replace(moe_dispatch=dispatch, moe_capacity_factor=1.0))
  x = np.random.default_rng(2).standard_normal((8, 5, cfg.hidden_size))
  y, r, _, _ = run(moe, jnp.asarray(x), make_mesh("data=2,expert=4"), grads=False)
  experts = np.asarray(r.experts_nk)
  keep = _np_kept(experts, cfg.num_experts, cap=8, groups=2)
  assert (~keep).sum() >= 10  # the case overflows by design
  assert int(r.dropped_pairs) == (~keep).sum()
  want = np_moe(moe, cfg, x, keep=keep)
  np.testing.assert_allclose(np64(y).reshape(want.shape), want, atol=ATOL, rtol=0)


def test_decode_few_tokens_scan_and_remat(x64):
  """3 tokens on 8 devices (padded to 8, the padding never sent) through two MoE layers
  scanned with lax.scan under remat, as transformer.py runs its layer stacks."""
  cfg = tiny_cfg()
  layers = [make_moe(cfg, seed, ex=F64) for seed in (3, 4)]
  graphdef, _ = nnx.split(layers[0])
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(m) for m in layers])
  x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 1, cfg.hidden_size)))

  def two_layers(state, x):
    @jax.checkpoint
    def body(h, s):
      y, r = nnx.merge(graphdef, s)(h)
      return h + y, r.experts_nk
    h, chosen = jax.lax.scan(body, x, state)
    return jnp.sum(jnp.sin(h)), (h, chosen)

  fn = jax.jit(jax.value_and_grad(two_layers, has_aux=True))
  (_, (h1, c1)), g1 = fn(stacked, x)
  mesh = make_mesh("data=2,expert=2,tensor=2")
  specs = jax.tree.map(lambda v: NamedSharding(mesh, P(None, *spec_of(v, mesh))),
                       nnx.state(layers[0]), is_leaf=lambda v: isinstance(v, nnx.Variable))
  with jax.set_mesh(mesh):
    (_, (h2, c2)), g2 = fn(jax.device_put(stacked, specs), x)
  np.testing.assert_array_equal(np.asarray(c1), np.asarray(c2))
  np.testing.assert_allclose(np64(h1), np64(h2), atol=ATOL, rtol=0)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np64(a), np64(b), atol=ATOL, rtol=0)


def test_no_all_gather_of_expert_weights():
  """The compiled forward+backward on expert=8 moves tokens (4 all-to-all: dispatch and return,
  and their transposes), the [EP, E] counts (one s32 all-gather), the dropped count and the
  data-parallel gradients of the replicated weights (router, down/up, norm, shared: one
  combined all-reduce); no float is gathered. Plain jit of the same sharded layer gathers
  every token's choices to every device. Experts over expert x fsdp: no weight gather; with
  fsdp on the latent width (the fallback) the only weight gathers are FSDP's, of the local
  experts."""
  cfg = tiny_cfg()
  e, l, f, n, k = (cfg.num_experts, cfg.latent_size, cfg.moe_intermediate_size, 40,
                   cfg.num_experts_per_token)
  ops = collectives(case_runs("expert8")[1][3])
  kinds = sorted(op for op, _, _ in ops)
  assert kinds == ["all-gather"] + ["all-reduce"] * 2 + ["all-to-all"] * 4, ops
  (gather,) = [t for op, t, _ in ops if op == "all-gather"]
  assert gather.startswith(f"s32[8,{e}]"), gather  # the count matrix
  assert not any(op == "all-gather" and f"s32[{n * k}]" in t for op, t, _ in ops)

  # the same sharded layer under plain jit (no mesh context: the one-device code)
  moe = make_moe(cfg)
  x = jnp.zeros((8, 5, cfg.hidden_size))
  mesh = make_mesh("expert=8")
  graphdef, state = nnx.split(moe)
  plain_fn = jax.jit(lambda s, x: grad_fn(nnx.merge(graphdef, s), x))
  xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
  plain = collectives(plain_fn.lower(placed(state, mesh), xs).compile().as_text())
  assert any(op == "all-gather" and f"s32[{n * k}]" in t for op, t, _ in plain), plain

  # experts over expert x fsdp (8 over 4 devices): no expert weight is gathered at all
  ragged = collectives(case_runs("ragged_emulated_fsdp2_expert2_tensor2")[1][3])
  assert not any(op == "all-gather" and re.search(rf"f64\[\d+,({l},{f // 2}|{f // 2},{l})\]", t)
                 for op, t, _ in ragged), ragged
  # the fallback (12 experts do not split over expert x fsdp = 8): FSDP gathers of the 3
  # local experts, whole width, and never of the whole stack
  e = 12
  stack = re.compile(rf"f64\[{e},({l},{f}|{f},{l})\]")
  fsdp = collectives(case_runs("fsdp2_expert4_12_experts")[1][3])
  expert_gathers = [t for op, t, src in fsdp if op == "all-gather" and "shard_map" in src
                    and re.search(rf"f64\[{e // 4},({l},{f}|{f},{l})\]", t)]
  assert len(expert_gathers) == 3, fsdp  # w1, w3, w2: the 3 local experts, whole width
  assert not any(op == "all-gather" and stack.search(t) for op, t, _ in fsdp), fsdp


def test_ragged_path_compiles_for_tpu():
  """ragged_all_to_all has no XLA:CPU lowering; compiling the layer's forward and backward for
  a v5e 2x2 topology (libtpu, no TPU needed) proves the ragged path lowers and partitions:
  the program holds ragged-all-to-all and no all-gather of expert weights."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  mesh = make_mesh("expert=2,tensor=2", devices=topo.devices)
  cfg = tiny_cfg()
  ex = Execution(dtype="bfloat16", moe_grouped_matmul="ragged_dot")  # dispatch: by platform
  graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, ex, rngs=nnx.Rngs(0))))
  state = jax.tree.map(
      lambda v: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                               sharding=NamedSharding(mesh, spec_of(v, mesh)))),
      state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  x = jax.ShapeDtypeStruct((4, 16, cfg.hidden_size), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("expert")))

  def tpu_loss(state, x):
    y, _ = nnx.merge(graphdef, state)(x)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(tpu_loss)).trace(state, x).lower(
        lowering_platforms=("tpu",)).compile().as_text()
  ops = collectives(hlo)
  assert sum(op == "ragged-all-to-all" for op, _, _ in ops) == 4, ops  # 2 forward, 2 backward
  assert not any(op == "all-gather" and t.startswith("bf16[8,") for op, t, _ in ops), ops


def test_other_meshes_keep_the_one_device_code():
  """A mesh without the k3jax axes (or of one device) leaves the MoE as it was: no shard_map."""
  cfg = tiny_cfg()
  moe = make_moe(cfg)
  x = jnp.zeros((2, 3, cfg.hidden_size))
  for mesh in (jax.make_mesh((8,), ("x",)), make_mesh("data=1", devices=jax.devices()[:1])):
    with jax.set_mesh(mesh):
      assert expert_parallel.context_mesh() is None
      jaxpr = str(jax.make_jaxpr(lambda x: moe(x)[0])(x))
    assert "shard_map" not in jaxpr


@pytest.mark.parametrize("case", ["expert8", "ragged_emulated_fsdp2_expert2_tensor2"])
def test_megablox_expert_parallel_equals_one_device(case, monkeypatch):
  """The "megablox" grouped matmul (JAX's Pallas TPU kernels, interpreted on the CPU) inside
  the expert-parallel body, in float32, against the one-device MoE in float64 on the same
  (float32) weights and input: forward, routing and every gradient. This covers its casts
  inside shard_map: a weight replicated over some mesh axes gets its gradient summed over
  them, and rows past the filled part of the receive buffer stay zero.

  Tolerance: the module docstring's bound with float32's u = 2^-24 in place of float64's:
  160 * 6.0e-8 * 1600 = 0.015 (float32 rounding of each intermediate is of the same order,
  u * |value|). A misrouted or dropped row, or an unsummed gradient, moves results by O(0.1)
  or more. The routing must agree exactly, which float32 cannot upset when the float64 run's
  k-th and (k+1)-th biased scores of every token are more than 1e-4 apart (checked)."""
  mesh_spec, _, dispatch, overrides = CASES[case]
  if dispatch == "ragged":
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  cfg32 = tiny_cfg(**overrides)
  ex32 = Execution(dtype="float32", param_dtype="float32", moe_dispatch=dispatch,
                   moe_grouped_matmul="megablox")
  moe32 = make_moe(cfg32, ex=ex32)
  bias = np.asarray(moe32.gate.bias.get_value())
  x32 = jnp.asarray(np.random.default_rng(1).standard_normal((8, 5, cfg32.hidden_size)),
                    jnp.float32)
  ep = run(moe32, x32, make_mesh(mesh_spec))
  with jax.enable_x64(True):
    ex64 = ex32.replace(dtype="float64", param_dtype="float64", moe_grouped_matmul=None)
    moe64 = make_moe(cfg32, bias=bias, ex=ex64)
    want = dict(nnx.to_flat_state(nnx.state(moe32, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(moe64, nnx.Param)):
      var.set_value(jnp.asarray(want[path].get_value(), jnp.float64))
    one = run(moe64, jnp.asarray(x32, jnp.float64))
    biased = np.sort(np64(one[1].scores_ne) + bias, axis=-1)[..., ::-1]
    k = cfg32.num_experts_per_token
    assert np.min(biased[..., k - 1] - biased[..., k]) > 1e-4
    assert_same(one, ep, atol=0.015)


def test_megablox_expert_parallel_in_a_layer_scan_equals_one_device():
  """The model scans its layers over stacked weights; differentiating that scan re-evaluates
  the expert-parallel body (the scan's linearization, the partial evaluation of the dispatch's
  platform_dependent), which refused megablox's unchecked kernels ("concatenate requires
  varying manual axes to match", in every `k3jax plan` of a mesh) until the shard_map itself
  ran unchecked. Two layers' weights, each layer's output summed: the value and every
  gradient against the same scan on one device in float64 (tolerance as above), and the
  program lowers for TPU."""
  cfg32 = tiny_cfg()
  ex32 = Execution(dtype="float32", param_dtype="float32", moe_grouped_matmul="megablox")
  graphdef, state = nnx.split(make_moe(cfg32, ex=ex32))
  layers = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a]), state)
  x32 = jnp.asarray(np.random.default_rng(2).standard_normal((8, 5, cfg32.hidden_size)),
                    jnp.float32)

  def loss(graphdef, layers, x):
    step = lambda c, s: (c + jnp.sum(jnp.sin(nnx.merge(graphdef, s)(x)[0])), None)
    return jax.lax.scan(step, jnp.zeros((), x.dtype), layers)[0]

  mesh = make_mesh("expert=8")
  placed_layers = jax.tree.map(
      lambda v: v.replace(jax.device_put(v.get_value(), NamedSharding(
          mesh, P(None, *spec_of(v.replace(v.get_value()[0]), mesh))))),
      layers, is_leaf=lambda v: isinstance(v, nnx.Variable))
  xs = jax.device_put(x32, NamedSharding(mesh, activation_spec(("batch", None, None), x32.shape,
                                                               mesh)))
  fn = jax.jit(jax.value_and_grad(functools.partial(loss, graphdef)))
  with jax.set_mesh(mesh):
    fn.trace(placed_layers, xs).lower(lowering_platforms=("tpu",))
    ep = fn(placed_layers, xs)
  with jax.enable_x64(True):
    ex64 = ex32.replace(dtype="float64", param_dtype="float64", moe_grouped_matmul=None)
    graphdef64, _ = nnx.split(make_moe(cfg32, ex=ex64))
    layers64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), layers)
    one = jax.jit(jax.value_and_grad(functools.partial(loss, graphdef64)))(
        layers64, jnp.asarray(x32, jnp.float64))
  np.testing.assert_allclose(np.asarray(ep[0]), np.asarray(one[0]), atol=0.015, rtol=0)
  for (path, a), (_, b) in zip(nnx.to_flat_state(ep[1]), nnx.to_flat_state(one[1])):
    np.testing.assert_allclose(np64(a.get_value()), np64(b.get_value()), atol=0.015, rtol=0,
                               err_msg=str(path))
