"""Shared set-up of the training tests: a micro K3 config (every part: KDA x3 + MLA + the
trailing MLA, AttnRes blocks, a dense first layer, LatentMoE with shared experts and QB) small
enough to compile quickly (expert widths stay multiples of 32 so `k3jax export` can write its
MXFP4 experts), and the run options every in-process run shares (one StepConfig, so
one compiled train step per test process)."""

import dataclasses
import json
import os

import numpy as np

import configs
from k3jax.train.loop import RunOptions

MICRO = configs.get("tiny").replace(
    hidden_size=32, num_layers=5, mla_layers=(3, 4), kda_num_heads=2, kda_head_dim=16,
    mla_num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
    v_head_dim=8, intermediate_size=64, num_experts=8, num_experts_per_token=2,
    num_shared_experts=1, moe_intermediate_size=32, latent_size=32, attn_res_block_size=2)

STEPS = 24


def micro_config_file(folder) -> str:
  path = os.path.join(folder, "micro.json")
  with open(path, "w") as f:
    json.dump({"format": "k3jax", "config": MICRO.to_dict()}, f)
  return path


def options(out, config_file, **changes) -> RunOptions:
  base = RunOptions(out=str(out), config=config_file, steps=STEPS, decay_steps=STEPS,
                    batch_size=4, seq_len=32, learning_rate=1e-2, warmup_steps=4,
                    eval_every=12, eval_batches=2, save_every=12, progress=False,
                    peak_tflops=1.0)
  return dataclasses.replace(base, **changes)


def cli_args(opts: RunOptions) -> list[str]:
  """The `k3jax train` arguments that reproduce `opts` (for subprocess runs)."""
  return ["train", "--out", opts.out, "--config", opts.config, "--steps", str(opts.steps),
          "--decay-steps", str(opts.decay_steps), "--batch-size", str(opts.batch_size),
          "--seq-len", str(opts.seq_len), "--lr", str(opts.learning_rate),
          "--warmup", str(opts.warmup_steps), "--eval-every", str(opts.eval_every),
          "--eval-batches", str(opts.eval_batches), "--save-every", str(opts.save_every),
          "--peak-tflops", str(opts.peak_tflops), "--no-progress"]


# what differs between two runs of the same steps: wall-clock figures
TIMING = {"step_time_s", "tokens_per_s", "mfu", "data_wait_s", "host_to_device_s", "device_s",
          "checkpoint_block_s"}


def assert_records_close(got, want, atol: float = 0.0) -> None:
  """Two runs' metrics.jsonl records equal, step by step and key by key (rtol 1e-9), the
  timing keys left out."""
  drop = lambda records: [{k: v for k, v in r.items() if k not in TIMING} for r in records]
  got, want = drop(got), drop(want)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for a, b in zip(got, want):
    assert a.keys() == b.keys(), a["step"]
    for key in a:
      np.testing.assert_allclose(np.asarray(a[key], np.float64), np.asarray(b[key], np.float64),
                                 rtol=1e-9, atol=atol, err_msg=f"step {a['step']} {key}")
