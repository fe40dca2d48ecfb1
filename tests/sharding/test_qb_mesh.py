"""Quantile Balancing over the batch mesh axes, as the sharded train step runs it: inside a
shard_map over data x fsdp x expert, each device holding its own rows, both estimators and
both threshold rules give the one-array result (docs/model.md#quantile-balancing,
docs/sharding.md)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.model.quantile_balancing import expert_load_stats, quantile_balancing_bias
from sharding.mesh import make_mesh
from sharding.rules import BATCH_MESH_AXES

N, E, K = 512, 16, 4


@pytest.mark.parametrize("method,rule", [("exact", "k3"), ("histogram", "per_expert")])
def test_qb_on_sharded_rows_equals_one_array(method, rule):
  rng = np.random.default_rng(0)
  scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(N, E)) + np.linspace(-1, 1, E),
                                      jnp.float32))
  bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32)
  mask = jnp.asarray(rng.random(N) > 0.1)
  qb = functools.partial(quantile_balancing_bias, top_k=K, method=method, bins=256,
                         thresholds=rule)
  want = qb(scores, bias, mask=mask)
  want_load = expert_load_stats(jax.lax.top_k(scores + bias, K)[1], E, mask=mask).counts

  def local(s, b, m):
    load = expert_load_stats(jax.lax.top_k(s + b, K)[1], E, mask=m, axis_name=BATCH_MESH_AXES)
    return qb(s, b, mask=m, axis_name=BATCH_MESH_AXES), load.counts

  mesh = make_mesh("data=2,fsdp=2,expert=2")
  got, load = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_MESH_AXES), P(),
                                                                 P(BATCH_MESH_AXES)),
                                    out_specs=P()))(scores, bias, mask)
  np.testing.assert_array_equal(np.asarray(load), np.asarray(want_load))
  # the same values: sorted (exact) or integer-binned (histogram) rows do not depend on
  # which device held them; only float32 interpolation rounding may differ
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
