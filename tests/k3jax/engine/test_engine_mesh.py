"""The engine on a mesh of 8 CPU devices gives what it gives on one device (float64): the
weights placed by the rules table, KDA heads over `tensor`, experts over `expert` (the MoE
expert-parallel inside shard_map), slots and latent pages whole on every device; with decode
blocks and narrower prefill rows too."""

import dataclasses

import jax
import numpy as np

from k3jax.engine.engine import Engine
from k3jax.engine.request import SamplingParams
from sharding.mesh import make_mesh
from sharding.placement import place_model
from tests.k3jax.engine.helpers import CONFIG, drain, model

MESH = "data=2,expert=2,tensor=2"


def test_mesh_serves_the_tokens_of_one_device():
  _check(CONFIG)


def test_mesh_decode_blocks_serve_the_tokens_of_one_device():
  _check(dataclasses.replace(CONFIG, decode_steps=4, prefill_widths=2))


def _check(config):
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    ps = [[int(t) for t in rng.integers(0, 64, n)] for n in (9, 30, 17)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
              SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=0),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)]
    arrivals = {0: [("0", ps[0], params[0]), ("1", ps[1], params[1])],
                2: [("2", ps[2], params[2])]}
    one = drain(Engine(model(), CONFIG), arrivals)
    mesh = make_mesh(MESH)
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
