"""`k3jax plan --mode decode --analytic` counts the serving engine's memory from sharded shapes:
its figures equal the bytes the real arrays hold on a device of a CPU mesh (8 fake devices,
data=2 x expert=2 x tensor=2): the paged cache as the engine's Runner builds and places it
(`paged.init_cache`, `paged.place`), and the model with its routed experts packed as MXFP4 in
the rules table's shardings (`place_model`)."""

import math

import jax
import pytest
from flax import nnx

from k3jax.engine.config import EngineConfig
from k3jax.model import lora, paged
from k3jax.model.transformer import K3Model
from k3jax.plan import decode, engine_memory
from k3jax.plan.request import Mode, PlanRequest
from sharding.mesh import make_mesh
from sharding.placement import place_model
from tests.k3jax.model.helpers import tiny_cfg

# every part of K3 (KDA, MLA, dense and LatentMoE layers, AttnRes); expert widths that MXFP4's
# blocks of 32 divide; heads and experts that the mesh's tensor and expert axes split
CFG = tiny_cfg(num_layers=4, mla_layers=(1, 3), attn_res_block_size=2, kda_num_heads=4,
               mla_num_heads=4, latent_size=32, moe_intermediate_size=64)
MESH = "data=2,expert=2,tensor=2"
REQUEST = PlanRequest(config="unused", topology="v5e:2x2", mode=Mode.DECODE, batch=3, seq=96,
                      prefill_chunk=16, page_size=8, num_pages=40, prefix_snapshots=5,
                      analytic=True)


def _device0_bytes(tree) -> int:
  """The bytes of every array of `tree` that live on the mesh's first device."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == dev)


@pytest.fixture(scope="module")
def setup():
  devices = jax.devices()[:8]
  ex = decode.serve_execution(REQUEST)
  return devices, ex, make_mesh(MESH, devices)


@pytest.mark.parametrize("request_, shards", [
    (REQUEST, 1),  # 3 slots do not divide over data x expert: one pool, whole on every device
    (REQUEST.replace(num_pages=None, prefix_snapshots=None, page_size=16), 1),
    (REQUEST.replace(batch=4, num_pages=48, prefix_snapshots=8), 4),  # a shard per data x expert
    (REQUEST.replace(batch=8, num_pages=96, prefix_snapshots=8, data_shards=8), 8)])  # 2 each
def test_cache_bytes_equal_the_placed_paged_cache(setup, request_, shards):
  devices, ex, mesh = setup
  variables = engine_memory.weight_variables(CFG, ex, "mxfp4")
  plan = decode.plan_one(request_, CFG, ex, devices, MESH, analytic=True, variables=variables)
  assert plan.data_shards == shards
  config = EngineConfig(max_num_seqs=request_.batch, max_model_len=request_.seq,
                        page_size=request_.page_size, num_pages=request_.num_pages,
                        prefill_chunk=request_.prefill_chunk,
                        prefix_snapshots=request_.prefix_snapshots, data_shards=shards)
  # what the engine's Runner builds, and where it puts it
  cache = paged.place(paged.init_cache(CFG, ex, slots=config.max_num_seqs,
                                       pages=config.pool_pages, page_size=config.page_size,
                                       snapshots=config.snapshots, shards=shards), mesh, shards)
  assert plan.kda_slot_bytes_per_device == _device0_bytes(cache.kda)
  assert plan.latent_page_bytes_per_device == _device0_bytes(cache.pages)
  assert plan.snapshot_bytes_per_device == _device0_bytes(cache.snapshots)
  assert plan.cache_bytes_per_device == _device0_bytes(cache)
  assert (plan.pool_pages, plan.snapshots) == (config.pool_pages, config.snapshots)
  # the KDA state splits its heads over tensor; the pages are whole on every device, or with
  # shards split over data x expert (4 devices)
  ways = 1 if shards == 1 else 4
  assert _device0_bytes(cache.kda) * 2 * ways == sum(x.nbytes for x in jax.tree.leaves(cache.kda))
  assert _device0_bytes(cache.pages) * ways == sum(x.nbytes for x in jax.tree.leaves(cache.pages))
  assert plan.peak_bytes_per_device == (plan.weight_bytes_per_device + plan.cache_bytes_per_device
                                        + max(plan.prefill_temp_bytes_per_device,
                                              plan.decode_temp_bytes_per_device))


def test_cache_bytes_with_pages_by_position_over_context():
  """On expert=2,context=2,tensor=2 the latent pages are 2 stripes per shard over `context`:
  the plan's figures are the placed striped cache's, a device holding half its shards' pages
  (the shards over expert: 2 of them)."""
  devices = jax.devices()[:8]
  ex = decode.serve_execution(REQUEST)
  mesh_spec = "expert=2,context=2,tensor=2"
  mesh = make_mesh(mesh_spec, devices)
  request_ = REQUEST.replace(batch=4, num_pages=48, prefix_snapshots=8)
  variables = engine_memory.weight_variables(CFG, ex, "mxfp4")
  plan = decode.plan_one(request_, CFG, ex, devices, mesh_spec, analytic=True,
                         variables=variables)
  assert (plan.data_shards, plan.context_shards) == (2, 2)
  cache = paged.place(paged.init_cache(CFG, ex, slots=4, pages=48, page_size=8, snapshots=8,
                                       shards=2, stripes=2), mesh, 2, 2)
  assert plan.latent_page_bytes_per_device == _device0_bytes(cache.pages)
  assert plan.kda_slot_bytes_per_device == _device0_bytes(cache.kda)
  assert _device0_bytes(cache.pages) * 4 == sum(x.nbytes for x in jax.tree.leaves(cache.pages))
  assert "pages by position over context=2" in plan.report()


def test_weight_bytes_equal_the_placed_packed_model(setup):
  devices, ex, mesh = setup
  model = K3Model(CFG, ex, rngs=nnx.Rngs(0))
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model)))
  dense = _device0_bytes_of(model, mesh)
  lora.adapt(model, lora.AdaptSpec(base_experts="mxfp4"), nnx.Rngs(0))
  packed = _device0_bytes_of(model, mesh)
  plans = {experts: decode.plan_one(REQUEST.replace(experts=experts), CFG, ex, devices, MESH,
                                    analytic=True,
                                    variables=engine_memory.weight_variables(CFG, ex, experts))
           for experts in ("mxfp4", "dequantized")}
  assert plans["mxfp4"].weight_bytes_per_device == packed
  assert plans["dequantized"].weight_bytes_per_device == dense
  assert plans["mxfp4"].param_count == plans["dequantized"].param_count == n_params
  assert plans["mxfp4"].experts == "mxfp4" and plans["mxfp4"].serving == "engine"
  # a bf16 expert weight (2 bytes) is held as half a code byte and 1/32 of a scale byte
  experts = sum(x.nbytes for p, x in _flat(model) if p[-1].endswith(("_packed", "_scale")))
  assert experts > 0
  expert_weights = sum(x.size * 2 if p[-1].endswith("_packed") else 0 for p, x in _flat(model))
  assert experts * 32 == expert_weights * 17


def _device0_bytes_of(model, mesh) -> int:
  place_model(model, mesh)
  return _device0_bytes(nnx.state(model))


def _flat(model):
  return [(tuple(str(k) for k in p), v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model))]


def test_largest_batch_search():
  assert engine_memory.largest(lambda n: n <= 37) == 37
  assert engine_memory.largest(lambda n: n <= 64) == 64
  assert engine_memory.largest(lambda n: False) == 0
  assert engine_memory.largest(lambda n: True, cap=100) == 100
  assert engine_memory.largest_multiple(lambda n: n <= 37, 4) == 36
  assert engine_memory.largest_multiple(lambda n: n <= 3, 4) == 0


def test_fsdp_gather_bytes_are_the_placed_dense_weights_gathered(setup):
  """On fsdp=2 x expert=2 x tensor=2 a step gathers every weight split over fsdp (a device
  receives the other half of each), except the routed experts, whose experts split over
  expert x fsdp and stay (tokens travel to them): counted from the placed model's arrays."""
  devices, ex, _ = setup
  mesh_spec = "fsdp=2,expert=2,tensor=2"
  model = K3Model(CFG, ex, rngs=nnx.Rngs(0))
  lora.adapt(model, lora.AdaptSpec(base_experts="mxfp4"), nnx.Rngs(0))
  place_model(model, make_mesh(mesh_spec, devices))
  want = moved_experts = 0
  for path, var in nnx.to_flat_state(nnx.state(model)):
    x = var.get_value()
    entries = [e if isinstance(e, tuple) else (e,) for e in x.sharding.spec]
    if any("fsdp" in e for e in entries):
      local = next(s.data.nbytes for s in x.addressable_shards if s.device == devices[0])
      if "experts" in tuple(map(str, path)):  # the routed experts' stacks
        moved_experts += local
      else:
        want += local  # the other fsdp device's half of it
  plan = decode.plan_one(REQUEST.replace(batch=4, num_pages=48, prefix_snapshots=8), CFG, ex,
                         devices, mesh_spec, analytic=True,
                         variables=engine_memory.weight_variables(CFG, ex, "mxfp4"))
  assert want > 0 and moved_experts > 0
  assert plan.fsdp_gather_bytes_per_device == want
  assert plan.fsdp_gather_seconds is not None  # v5e's ICI is known
