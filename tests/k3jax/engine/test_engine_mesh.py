"""The engine on a mesh of 8 CPU devices gives what it gives on one device (float64): the
weights placed by the rules table, KDA heads over `tensor`, experts over `expert` (the MoE
expert-parallel inside shard_map), slots and latent pages whole on every device; with decode
blocks and narrower prefill rows too; and with the pools in 4 shards over data x expert (each
device holding its shard's slots, pages and snapshots, the mixers under shard_map)."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from k3jax.engine import runner
from k3jax.engine.engine import Engine
from k3jax.engine.request import SamplingParams
from k3jax.plan.hlo import collectives
from sharding.mesh import make_mesh
from sharding.placement import place_model
from tests.k3jax.engine.helpers import CONFIG, drain, model

MESH = "data=2,expert=2,tensor=2"


def test_mesh_serves_the_tokens_of_one_device():
  _check(CONFIG)


def test_mesh_decode_blocks_serve_the_tokens_of_one_device():
  _check(dataclasses.replace(CONFIG, decode_steps=4, prefill_widths=2))


@pytest.mark.parametrize("mesh, axes, steps", [(MESH, ("data", "expert"), 4),
                                               ("fsdp=4,tensor=2", "fsdp", 1)])
def test_mesh_pool_shards_serve_the_tokens_of_one_device(mesh, axes, steps):
  """With decode blocks (shard_map inside the block's loop); and on an fsdp mesh: the weights
  split over fsdp too (gathered for use), the pools' shards over fsdp."""
  engine = _check(dataclasses.replace(CONFIG, data_shards=4, num_pages=48, decode_steps=steps,
                                      prefill_widths=2), mesh)
  cache = engine.runner.cache
  for pool in (cache.kda[0].recurrent, cache.snapshots[0].recurrent, cache.pages[0].c):
    assert pool.sharding.spec[0] == axes
    assert pool.addressable_shards[0].data.shape[0] == pool.shape[0] // 4  # one shard each
  assert engine.runner.pools == (4, axes if isinstance(axes, tuple) else (axes,), 1)


def test_pool_shards_move_no_page_or_state_between_devices(monkeypatch):
  """The compiled mixed step of 4 pool shards over data x expert: no collective carries a
  pool, a device's shard of one or a row's gathered context (the mixers read their own
  device's shards, under shard_map); what moves is the step's token activations."""
  captured = []
  step = runner._step

  def spy(*args, **kwargs):  # the avals and shardings of a mixed step's call
    if len(args[4]) == 2 and not captured:
      captured.append(jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
          if isinstance(a, jax.Array) else a, (args, kwargs)))
    return step(*args, **kwargs)
  monkeypatch.setattr(runner, "_step", spy)
  config = dataclasses.replace(CONFIG, data_shards=4, num_pages=48)
  with jax.enable_x64(True):
    mesh = make_mesh(MESH)
    m = model()
    place_model(m, mesh)
    engine = Engine(m, config, mesh=mesh)
    drain(engine, {0: [("a", list(range(1, 30)), SamplingParams(max_tokens=2,
                                                                  temperature=0.0))]})
    args, kwargs = captured[0]
    with jax.set_mesh(mesh):
      hlo = step.lower(*args, **kwargs).compile().as_text()
  cache = engine.runner.cache
  ctx_pages = kwargs["ctx_pages"]
  ctx = ctx_pages * config.page_size
  squeeze = lambda shape: tuple(d for d in shape if d != 1)
  pools = [a.shape for a in jax.tree.leaves(cache)]
  pools = {squeeze(p) for n, *rest in pools for p in ((n, *rest), (n // 4, *rest))}
  ops = collectives(hlo)
  assert ops, "expected the token activations to move"
  for c in ops:
    for dims in re.findall(r"\[([\d,]*)\]", c.result):
      shape = squeeze(int(d) for d in dims.split(",") if d)
      assert ctx not in shape, c                  # a row's gathered context, by position
      assert (ctx_pages, config.page_size) not in set(zip(shape, shape[1:])), c  # by page
      assert shape not in pools, c                # a pool, or a device's shard of one


def test_pool_shards_must_divide_over_the_mesh():
  with pytest.raises(ValueError, match="data_shards 2 do not divide over the mesh's 4"):
    Engine(model(), dataclasses.replace(CONFIG, data_shards=2, num_pages=48),
           mesh=make_mesh(MESH))


def _check(config, mesh_spec=MESH):
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    ps = [[int(t) for t in rng.integers(0, 64, n)] for n in (9, 30, 17)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
              SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=0),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)]
    arrivals = {0: [("0", ps[0], params[0]), ("1", ps[1], params[1])],
                2: [("2", ps[2], params[2])]}
    one = drain(Engine(model(), CONFIG), arrivals)
    mesh = make_mesh(mesh_spec)
    sharded_model = model()
    place_model(sharded_model, mesh)
    engine = Engine(sharded_model, config, mesh=mesh)
    heads = engine.runner.cache.kda[0].recurrent.sharding.spec
    assert "tensor" in jax.tree.leaves(tuple(heads))
    many = drain(engine, arrivals)
  assert engine.block_calls > 0 or config.decode_steps == 1
  for rid in one:
    assert many[rid].tokens == one[rid].tokens
    np.testing.assert_allclose(many[rid].logprobs, one[rid].logprobs, rtol=0, atol=1e-12)
  return engine
