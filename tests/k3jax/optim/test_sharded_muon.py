"""Per-Head Muon on a mesh: where each Newton-Schulz block runs, read from the compiled
optimizer update (the update alone, jitted with the parameters' shardings; docs/training.md,
docs/sharding.md).

  * blocks split only over heads (`tensor`) or experts (`expert`, and `fsdp` where the rules
    table gives the experts expert x fsdp) are whole on their devices: the update has no
    collective at all;
  * a block split over `fsdp` (or `tensor` inside the block): XLA's partitioner would run
    Newton-Schulz distributed, a collective every iteration (all-reduced Gram matrices or
    all-gathered blocks); the default layout (k3jax/optim/ns_layout.py) moves the mesh axes
    onto a batch axis instead (all-to-alls there and back), so the iteration runs without
    communication and the bytes moved drop (numbers printed with -s)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.model.moe import RouterBias
from k3jax.model.transformer import K3Model
from k3jax.optim import logical_axes_from_state, ns_layout, per_head_muon
from k3jax.optim.groups import dimension_numbers
from k3jax.optim.ns_layout import ns_flops, ns_placement
from k3jax.plan.hlo import collectives, matmul_flops, summary
from k3jax.train.step import plain
from sharding.mesh import make_mesh
from sharding.placement import like_params, variable_shardings

PER_HEAD = [("kda", "q_proj"), ("kda", "k_proj"), ("kda", "v_proj"), ("mla", "q_b_proj"),
            ("mla", "k_b_proj"), ("mla", "v_b_proj")]
EXPERTS = [("moe", "experts", "w1"), ("moe", "experts", "w2"), ("moe", "experts", "w3")]


@pytest.fixture(scope="module")
def tiny_tree():
  model = nnx.eval_shape(lambda: K3Model(configs.get("tiny"), rngs=nnx.Rngs(0)))
  _, params, _, _ = nnx.split(model, nnx.Param, RouterBias, ...)
  return params


def pick(params: nnx.State, paths) -> nnx.State:
  flat = dict(nnx.to_flat_state(params))
  keep = {p: v for p, v in flat.items() if any(p[:len(q)] == q for q in paths)}
  assert len(keep) == len(paths)
  return nnx.from_flat_state(keep)


def update_collectives(params: nnx.State, mesh, whole_blocks=True):
  """Collectives of one compiled Per-Head Muon update of `params` placed on `mesh`."""
  axes = plain(logical_axes_from_state(params))
  shardings = variable_shardings(params, mesh)
  sds = plain(nnx.as_pure(params))
  tx = per_head_muon(0.01, logical_axes=axes, whole_blocks=whole_blocks)
  opt = jax.eval_shape(tx.init, sds)
  opt_sh = like_params(opt, sds, shardings, mesh)
  update = jax.jit(tx.update, in_shardings=(shardings, opt_sh, shardings),
                   out_shardings=(shardings, opt_sh))
  with jax.set_mesh(mesh):
    return collectives(update.lower(sds, opt, sds).compile().as_text())


def test_per_head_blocks_need_no_communication(tiny_tree):
  """KDA q/k/v and MLA q_b/k_b/v_b with heads on tensor (and experts on expert, batch over
  data x expert): no collective, whatever the layout option."""
  mesh = make_mesh("data=2,expert=2,tensor=2")
  params = pick(tiny_tree, PER_HEAD)
  for spec in jax.tree.leaves(variable_shardings(params, mesh)):
    assert "tensor" in str(spec.spec)  # really split over heads
  assert update_collectives(params, mesh) == []
  assert update_collectives(params, mesh, whole_blocks=False) == []


def test_per_expert_blocks_need_no_communication(tiny_tree):
  """Experts over expert (data=4,expert=2) or over expert x fsdp (fsdp=2,expert=4): whole
  blocks, no collective."""
  for spec, experts_on in (("data=4,expert=2", "expert"), ("fsdp=2,expert=4", ("expert", "fsdp"))):
    mesh = make_mesh(spec)
    params = pick(tiny_tree, EXPERTS)
    for sh in jax.tree.leaves(variable_shardings(params, mesh)):
      assert sh.spec[1] == experts_on and "fsdp" not in str(sh.spec[2:]), (spec, sh.spec)
    assert update_collectives(params, mesh) == [], spec


def test_fsdp_split_blocks():
  """Expert and latent matrices with the model width on fsdp (and moe_mlp on tensor; 6
  experts do not split over expert x fsdp = 4, so the experts' latent width takes fsdp, the
  rules table's fallback). Left to the partitioner, each parameter's Newton-Schulz
  communicates every iteration (>= 5 collectives); in the whole-block layout the blocks only
  move there and back (all-to-alls, one per mesh axis moved) and the iteration communicates
  nothing, with fewer bytes moved. MLA g_proj (3 layers, a whole-matrix block per layer) has
  no batch axis fsdp x tensor divides: its layer axis is padded to 4 with zero blocks."""
  mesh = make_mesh("fsdp=2,expert=2,tensor=2")
  model = nnx.eval_shape(lambda: K3Model(configs.get("tiny", num_experts=6), rngs=nnx.Rngs(0)))
  _, tiny_tree, _, _ = nnx.split(model, nnx.Param, RouterBias, ...)
  paths = EXPERTS[:1] + [("moe", "routed_down"), ("mla", "g_proj")]
  params = pick(tiny_tree, paths)
  for path, var in nnx.to_flat_state(params):
    names = tuple(var.get_metadata()["out_sharding"])
    home = jax.tree.leaves(variable_shardings(nnx.from_flat_state({path: var}),
                                              mesh))[0].spec
    there, padded, split = ns_placement(home, var.shape, dimension_numbers(names),
                                        dict(mesh.shape))
    assert split == (), (path, split)  # blocks this small stay whole: the psums would cost more
    assert padded == ((4,) + var.shape[1:] if path[0] == "mla" else var.shape), (path, padded)
    assert "fsdp" in str(home), (path, home)  # really split over fsdp at home
    assert all(e is None for e in tuple(there)[2:]), (path, there)  # whole blocks
  for path in paths:
    one = pick(tiny_tree, [path])
    auto = update_collectives(one, mesh, whole_blocks=False)
    whole = update_collectives(one, mesh, whole_blocks=True)
    print(f"\n{'.'.join(path)}: partitioner {summary(auto)}; whole blocks {summary(whole)}")
    assert len(auto) >= 5
    assert {c.op for c in whole} == {"all-to-all"}  # moves only; nothing inside the loop
    assert sum(c.bytes for c in whole) < sum(c.bytes for c in auto)


def sharded_update(params, mesh):
  """(one-device update, the update on `mesh` under jax.set_mesh, its compiled HLO) of
  float64 gradients of `params`, the gradients standing in for the parameters too."""
  axes = plain(logical_axes_from_state(params))
  shardings = variable_shardings(params, mesh)
  with jax.enable_x64(True):
    tx = per_head_muon(0.01, logical_axes=axes)
    grads = jax.tree.map(lambda s: jax.random.normal(jax.random.key(0), s.shape, jnp.float64),
                         plain(nnx.as_pure(params)))
    want, _ = jax.jit(tx.update)(grads, tx.init(grads), grads)
    opt_sh = like_params(jax.eval_shape(tx.init, grads), grads, shardings, mesh)
    update = jax.jit(tx.update, in_shardings=(shardings, opt_sh, shardings),
                     out_shardings=(shardings, opt_sh))
    placed = jax.device_put(grads, shardings)
    state = jax.device_put(tx.init(grads), opt_sh)
    with jax.set_mesh(mesh):
      got, _ = update(placed, state, placed)
      hlo = update.lower(placed, state, placed).compile().as_text()
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0,
                               atol=1e-10 * np.abs(np.asarray(a)).max())
  return hlo


def test_one_block_stack_is_split_over_the_mesh():
  """Layer 0's dense MLP, a stack of one block ([1, 512, 1024]) on fsdp=2,expert=2,tensor=2:
  orthogonalised with the long side split over fsdp x tensor where it lies (4 ways), one psum
  of the [512, 512] Gram matrix per iteration, not padded with 3 zero blocks of which each
  device orthogonalises one whole. Each device's 256 columns are fewer than m = 512 rows, so
  the update is a X + b A X + c A (A X): 5 x 6 m^2 n/4 matmul FLOPs per device, against
  5 (4 m^2 n / 4 + 2 m^3) for (b A + c A A) X and 5 (4 m^2 n + 2 m^3) for a whole block. The
  update equals the one-device update (float64: summation order only)."""
  mesh = make_mesh("fsdp=2,expert=2,tensor=2")
  model = nnx.eval_shape(lambda: K3Model(configs.get("tiny", hidden_size=512,
                                                     intermediate_size=1024),
                                         rngs=nnx.Rngs(0)))
  path = ("dense_mlp", "gate_proj")
  params = pick(nnx.split(model, nnx.Param, RouterBias, ...)[1], [path])
  (_, var), = nnx.to_flat_state(params)
  _, m, n = var.shape
  home = jax.tree.leaves(variable_shardings(params, mesh))[0].spec
  placement = ns_placement(home, var.shape,
                           dimension_numbers(tuple(var.get_metadata()["out_sharding"])),
                           dict(mesh.shape))
  assert placement.split == ("fsdp", "tensor") and placement.shape == var.shape, placement
  hlo = sharded_update(params, mesh)
  gram = f"f64[{m},{m}]"
  reduces = [c for c in collectives(hlo) if c.op == "all-reduce" and gram in c.result]
  assert len(reduces) == 5, summary(collectives(hlo))
  split = 5 * 6 * m * m * n / 4
  assert matmul_flops(hlo) == pytest.approx(split, rel=0.01), (matmul_flops(hlo), split)


def test_every_layout_gives_the_one_device_update(tiny_tree, monkeypatch):
  """With the all-reduces priced at zero, ns_placement splits the long side wherever that cuts
  the FLOPs, so the tiny model's tree on fsdp=4,tensor=2 takes every kind of placement: split blocks
  alone (MLA g/o, layer 0's MLP), split blocks with a mesh axis moved onto the layers (KDA
  g/o), whole blocks padded with zero blocks (KDA q/k/v), whole blocks moved without padding
  (experts). Every parameter's update equals the one-device update (float64)."""
  monkeypatch.setattr(ns_layout, "FLOPS_PER_ALL_REDUCED_BYTE", 0.0)
  mesh = make_mesh("fsdp=4,tensor=2")
  kinds = set()
  for path, var in nnx.to_flat_state(tiny_tree):
    names = tuple(var.get_metadata()["out_sharding"])
    if dimension_numbers(names) is None:
      continue
    home = jax.tree.leaves(variable_shardings(nnx.from_flat_state({path: var}), mesh))[0].spec
    there, padded, split = ns_placement(home, var.shape, dimension_numbers(names),
                                        dict(mesh.shape))
    kinds.add((bool(split), there != home, padded != var.shape))
  assert {(True, False, False), (True, True, False), (False, True, True),
          (False, True, False)} <= kinds, kinds
  sharded_update(tiny_tree, mesh)


def test_k3_stacks_are_split_rather_than_padded():
  """K3 on fsdp=128 x tensor=8 (the fitting v5p mesh): padding every stack to whole blocks per
  device made each device's Newton-Schulz 1.9x the hand count's share (MLA g/o padded 24 ->
  1024 layers, KDA g/o 69 -> 1024, the shared experts 92 -> 1024); with the long side split
  over tensor where that is cheaper (ns_cost), 1.1x. Placements only (no compile)."""
  from k3jax.train.flops import newton_schulz_flops
  from sharding.rules import logical_to_spec
  cfg = configs.get("k3")
  mesh = jax.sharding.AbstractMesh((1, 128, 1, 8), ("data", "fsdp", "expert", "tensor"))
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  whole = split = 0.0
  for path, var in nnx.to_flat_state(nnx.split(model, nnx.Param, RouterBias, ...)[1]):
    names = tuple(var.get_metadata()["out_sharding"])
    dn = dimension_numbers(names)
    if dn is None:
      continue
    home = logical_to_spec(names, mesh=mesh, shape=var.shape)
    placement = ns_placement(home, var.shape, dn, dict(mesh.shape))
    split += ns_flops(placement, dn, dict(mesh.shape))
    with pytest.MonkeyPatch.context() as mp:  # the whole-block placement: split psums priced out
      mp.setattr(ns_layout, "FLOPS_PER_ALL_REDUCED_BYTE", float("inf"))
      whole += ns_flops(ns_placement(home, var.shape, dn, dict(mesh.shape)), dn, dict(mesh.shape))
    if path[:2] in (("kda", "g_proj"), ("mla", "o_proj"), ("moe", "shared_experts")):
      assert placement.split == ("tensor",) and placement.shape[0] == 128, (path, placement)
  hand = newton_schulz_flops(cfg) / 5 / 1024
  print(f"\nper device and iteration: hand count {hand:.3e}, whole blocks {whole / hand:.2f}x, "
        f"chosen {split / hand:.2f}x")
  assert whole > 1.8 * hand and split < 1.15 * hand
