"""Decode context parallelism (docs/serving.md, "Long requests"): with a request's MLA latent
pages spread by position over the mesh's `context` axis (EngineConfig.context_shards), each
device attending over its own pages and the partial softmaxes merged across the axis, and the
KDA state split by heads over `tensor`, the engine on 8 CPU devices gives the one-device
tokens and logprobs (float64, 1e-12): a prompt of 60 tokens (8 pages) read in chunks of 16
while each device holds 4 pages, a second request restoring 40 of its tokens from the prefix
cache, a third beside them; and the same with the pools in 2 shards over `data` and decode
blocks of 4 steps."""

import dataclasses

import jax
import numpy as np
import pytest

from k3jax.engine.config import EngineConfig
from k3jax.engine.engine import Engine
from k3jax.engine.request import SamplingParams
from sharding.mesh import make_mesh
from sharding.placement import place_model
from tests.k3jax.engine.helpers import CONFIG, drain, model


def _arrivals():
  rng = np.random.default_rng(0)
  ids = lambda n: [int(t) for t in rng.integers(0, 64, n)]
  long = ids(60)
  return {0: [("long", long, SamplingParams(max_tokens=20, temperature=0.0, logprobs=2))],
          6: [("prefix", long[:40] + ids(10), SamplingParams(max_tokens=6, temperature=0.8,
                                                               seed=5, logprobs=2)),
              ("other", ids(17), SamplingParams(max_tokens=6, temperature=0.0, logprobs=2))]}


@pytest.mark.parametrize("mesh_spec, pages, shards, steps", [
    ("context=4,tensor=2", 16, 1, 1),
    # pools in 2 shards with decode blocks: a minute more on the 2-core CPU
    pytest.param("data=2,context=2,tensor=2", 24, 2, 4, marks=pytest.mark.long)])
def test_position_sharded_pages_serve_the_tokens_of_one_device(mesh_spec, pages, shards, steps):
  mesh = make_mesh(mesh_spec)
  stripes = mesh.shape["context"]
  config = dataclasses.replace(CONFIG, num_pages=pages, context_shards=stripes,
                               data_shards=shards, decode_steps=steps)
  per_device = pages // (shards * stripes)
  assert per_device * CONFIG.page_size < 60  # the long prompt needs more than one device holds
  with jax.enable_x64(True):
    one = drain(Engine(model(), dataclasses.replace(CONFIG, num_pages=pages)), _arrivals())
    sharded = model()
    place_model(sharded, mesh)
    engine = Engine(sharded, config, mesh=mesh)
    many = drain(engine, _arrivals())
  cache = engine.runner.cache
  c = cache.pages[0].c
  assert c.addressable_shards[0].data.shape[0] == per_device + 1  # its stripe and a scratch page
  assert "context" in jax.tree.leaves(tuple(c.sharding.spec))
  assert "tensor" in jax.tree.leaves(tuple(cache.kda[0].recurrent.sharding.spec))
  if shards == 1:  # (with 2 shards the second request may be placed on the other one)
    assert engine.scheduler.hit_tokens >= 32
  for rid in one:
    assert many[rid].tokens == one[rid].tokens, rid
    np.testing.assert_allclose(many[rid].logprobs, one[rid].logprobs, rtol=0, atol=1e-12)
    for got, want in zip(many[rid].top, one[rid].top):
      assert sorted(got) == sorted(want), rid
      np.testing.assert_allclose([got[t] for t in want], list(want.values()), rtol=0,
                                 atol=1e-12)


def test_context_shards_must_be_the_mesh_axis():
  with pytest.raises(ValueError, match=r"context_shards 1 must be the mesh's context axis "
                                       r"\(4 devices\)"):
    Engine(model(), dataclasses.replace(CONFIG, num_pages=16),
           mesh=make_mesh("context=4,tensor=2"))
  with pytest.raises(ValueError, match="num_pages 18 does not divide into data_shards 1 x "
                                       "context_shards 4"):
    EngineConfig(max_model_len=96, page_size=8, num_pages=18, context_shards=4)
