"""`k3jax plan --mode rl`: per mesh, the LoRA plan's step beside the engine plan's cache, as the
two modes report them on the same mesh (docs/plan.md#rl-mode)."""

import json

import pytest

from k3jax import cli, plan

COMMON = dict(config="tiny", topology="v5e:2x2", batch=8, seq=256, grad_accum=2,
              lora_rank=4, base_experts="float", analytic=True)


@pytest.mark.parametrize("mesh", ["expert=2,tensor=2", "fsdp=4"])
def test_rl_is_the_lora_step_beside_the_engine_cache(mesh):
  rl, = plan.run(plan.PlanRequest(**COMMON, mode=plan.Mode.RL, mesh=mesh))
  # RL plans its step at `k3jax train`'s defaults for the knobs it is not given
  lora, = plan.run(plan.PlanRequest(**COMMON, mode=plan.Mode.LORA, mesh=mesh, remat="none",
                                    attention="dense", loss_chunk=0, capacity_factor=0))
  # RL's engine keeps one pool (its rollouts do not take --data-shards)
  serve, = plan.run(plan.PlanRequest(**COMMON, mode=plan.Mode.DECODE, mesh=mesh,
                                     serving="engine", data_shards=1))
  assert rl.mesh == lora.mesh == serve.mesh
  cache = serve.cache_bytes_per_device
  temp = max(serve.prefill_temp_bytes_per_device, serve.decode_temp_bytes_per_device)
  assert rl.train_peak_bytes_per_device == lora.peak_bytes_per_device
  assert rl.train_state_bytes_per_device == lora.state_bytes_per_device
  assert rl.engine_cache_bytes_per_device == cache
  assert rl.engine_temp_bytes_per_device == temp
  assert rl.kda_slots_bytes_per_device + rl.latent_pages_bytes_per_device + \
      rl.snapshots_bytes_per_device == pytest.approx(cache, rel=1e-12)
  assert rl.peak_bytes_per_device == max(lora.peak_bytes_per_device + cache,
                                         lora.state_bytes_per_device + cache + temp)
  assert rl.fits == (rl.peak_bytes_per_device <= rl.hbm_bytes_per_device)


def test_the_command_searches_meshes_and_prints_one_json_object(capsys):
  assert cli.main(["plan", "--config", "tiny", "--topology", "v5e:2x2", "--mode", "rl",
                   "--batch", "8", "--seq", "256", "--lora", "4", "--base-experts", "float",
                   "--json"]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["mode"] == "rl" and out["fits"] and len(out["candidates"]) > 1
  chosen = {k: v for k, v in out.items() if k != "candidates"}
  assert chosen in out["candidates"]
  assert chosen["step_seconds_estimate"] == min(c["step_seconds_estimate"]
                                                for c in out["candidates"] if c["fits"])
