"""RL: the time of a `k3jax rl` step split into rollout / reward / reference / train on a
small K3-shaped model, and the memory plan of LoRA RL on the full K3.

    python benchmarks/rl.py                   # d=512, 8 layers, 8 prompts x 8 samples of 64
    python benchmarks/rl.py --quick --json    # reduced sizes (minutes on a 2-core CPU)
    python benchmarks/rl.py --tiny            # a smoke run of the script (no measurement)

(a) Step time. A K3-shaped model (benchmarks/serve.py's `model_config`: [KDA, KDA, KDA, MLA]
    blocks, dense first layer, LatentMoE with expert fan-in 256, AttnRes, K3's per-head sizes)
    with a byte vocabulary (256 ids: `k3jax rl` reads and writes text, and a folder without a
    tokenizer is byte-level), random bf16 weights, is saved as a model folder (model/ +
    run.json, as `k3jax train` writes one) in a temporary directory, beside a prompts JSONL of
    two-digit additions ("07+35=", `answer` "42"; every prompt 6 bytes). `k3jax.rl.loop.run`
    then runs --steps RL steps of B prompts x G samples of T tokens (temperature 1, GRPO, the
    `numeric` reward), in process, twice:

      full   full fine-tuning: Per-Head Muon + AdamW over fp32 masters, the reference policy a
             copy of the initial weights;
      LoRA   adapters of rank --lora on the default targets over the frozen base with its
             routed experts packed as MXFP4 (the expert fan-ins are multiples of 32), AdamW on
             the adapters, the reference the base with the adapters off.

    Each step's metrics record (docs/rl.md#metrics) holds its wall seconds by phase: rollout
    (B x G completions on the engine, every slot at once), reward, reference (the reference
    policy's logprobs of the rollouts), train (one optimizer step and the engine's new
    weights); and the generated tokens per rollout second. The first step compiles the
    engine's steps, the reference logprobs and the train step: it is reported apart and left
    out; the figures are the medians over the other steps. A random model emits no stop token
    (the model has none): every completion runs to T tokens, so every step does the same work.

(b) Memory plan of LoRA RL on the full K3 (config `k3`), counted by hand, no compile
    (`k3jax.plan` in process, `--analytic`): one process holds the LoRA train state (bf16
    frozen base, MXFP4 routed experts, adapters and their AdamW state) and the engine, which
    serves the same arrays (no second copy of the weights) and keeps its cache between steps.
    Per device, on each slice of --topologies:

      train      the analytic LoRA plan (`k3jax plan --mode lora --analytic`) of the train
                 step on B x G rows of --seq positions, rank --plan-rank, full remat, flash MLA,
                 loss chunk 2048, dropless experts (`k3jax rl` refuses a capacity factor),
                 micro-batches (`grad_accum`) so that a tensor=8 mesh's batch axes hold one row
                 each: its peak (state + batch + temporaries);
      cache      the engine's cache (`k3jax plan --mode decode --serving engine --analytic`'s
                 count, `k3jax.plan.decode.engine_figures`): B x G slots at --seq, KDA slots,
                 latent pages and prefix-cache snapshots (2 per slot), as `k3jax rl` builds its
                 engine (pages of 64 positions);
      total      the larger of the train phase (train peak + cache) and the rollout phase
                 (train state + cache + the engine step's temporaries), against the chip's HBM.

    The mesh is the LoRA plan's candidate with the smallest total (the engine runs on the
    trainer's mesh). Every figure of (b) is analytic. Not counted: the policy-gradient
    batch's extra float32 arrays (old and reference logprobs, advantages, token weights; 8 MiB
    for 64 x 8192 rows in all, split over the batch axes) and the reference pass's
    temporaries (a forward: less than the train step's).

The last line with --json is one JSON object: step_s {full, lora: {rollout, reward, reference,
train, total}}, tokens_per_s, first_step_s, and plan {slice: {train_lora_gib,
engine_cache_gib, total_gib, fits, ...}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import numpy as np

from benchmarks.serve import model_config, random_model
from k3jax import plan
from k3jax.rl.loop import RLOptions
from k3jax.rl.loop import run as rl_run
from k3jax.train.checkpoint import save_model
from k3jax.train.step import split_model

GIB = 2**30
PHASES = ("rollout", "reward", "reference", "train")
# per chip two slices, one twice the other: where the plan crosses the HBM
DEFAULT_TOPOLOGIES = "v5p:2x4x4,v5p:4x4x4,tpu7x:2x2x4,tpu7x:2x4x4"


@dataclasses.dataclass(frozen=True)
class Size:
  """One run's sizes: the model's widths (what serve.model_config reads) and the RL step's."""
  hidden: int
  layers: int
  prompts: int        # B, prompts per step
  group: int          # G, samples per prompt
  tokens: int         # T, max new tokens
  steps: int          # the first compiles and is left out


FULL = Size(hidden=512, layers=8, prompts=8, group=8, tokens=64, steps=6)
QUICK = Size(hidden=256, layers=4, prompts=4, group=8, tokens=32, steps=4)
TINY = Size(hidden=128, layers=4, prompts=2, group=2, tokens=4, steps=2)


def rl_config(size: Size):
  """serve.py's K3-shaped model with a byte vocabulary (no tokenizer file: byte-level)."""
  return model_config(size).replace(vocab_size=256)


def save_folder(root: str, cfg, seed: int) -> str:
  """A `k3jax train`-style output: model/ (bf16 random weights) + run.json (byte tokenizer)."""
  out = os.path.join(root, "init")
  graphdef, params, bias = split_model(random_model(cfg, "bfloat16", seed))
  save_model(os.path.join(out, "model"), graphdef, params, bias, cfg)
  with open(os.path.join(out, "run.json"), "w") as f:
    json.dump({"options": {"tokenizer": "byte", "init_from": None}, "model": cfg.to_dict()}, f)
  return out


def write_prompts(root: str, n: int, seed: int) -> str:
  """n two-digit additions, every prompt the same 6 bytes long (one prefill shape)."""
  rng = np.random.default_rng(seed)
  path = os.path.join(root, "prompts.jsonl")
  with open(path, "w") as f:
    for a, b in rng.integers(0, 100, (n, 2)):
      f.write(json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b)}) + "\n")
  return path


def run_rl(name: str, folder: str, data: str, root: str, size: Size, dtype: str, seed: int,
           **kw) -> list[dict]:
  """The metrics records of one in-process `k3jax rl` run."""
  records = []
  opts = RLOptions(init_from=folder, data=data, reward=("numeric",), group_size=size.group,
                   steps=size.steps, out=os.path.join(root, name),
                   prompts_per_step=size.prompts, max_new_tokens=size.tokens,
                   learning_rate=1e-5, dtype=dtype, seed=seed, save_every=10**9,
                   tensorboard=False, plots=False, progress=False, **kw)
  t0 = time.perf_counter()
  rl_run(opts, on_step=lambda s, r: records.append(r))
  print(f"{name}: {size.steps} steps in {time.perf_counter() - t0:.1f} s (with the final "
        "checkpoint and model save)", file=sys.stderr, flush=True)
  return records


def summary(records: list[dict]) -> dict:
  """Medians over the steps after the first (the first alone when there is no other)."""
  timed = records[1:] or records
  med = lambda key: statistics.median(r[key] for r in timed)
  return {"step_s": {**{p: med(f"{p}_s") for p in PHASES}, "total": med("step_time_s")},
          "tokens_per_s": med("tokens_per_s"), "completion_len": med("completion_len"),
          "first_step_s": records[0]["step_time_s"], "timed_steps": len(records) - 1}


def rl_memory(topology: str, slots: int, seq: int, rank: int) -> dict:
  """Per-device bytes of LoRA RL on the full K3 on `topology`, analytic (`k3jax plan --mode
  rl`): the LoRA train plan and the engine's cache on the same mesh (the search's candidate
  with the smallest total)."""
  n = len(plan.topology_devices(topology))
  # a tensor=8 mesh splits the rows over n / 8 devices: one row each per micro-batch
  ways = max(1, n // 8)
  accum = slots // ways if ways <= slots and slots % ways == 0 else 1
  plans = plan.run(plan.PlanRequest(
      config="k3", topology=topology, batch=slots, seq=seq, analytic=True, mode=plan.Mode.RL,
      grad_accum=accum, lora_rank=rank, base_experts="mxfp4", remat="full", attention="flash",
      loss_chunk=2048))
  p = plans[0]  # sorted: fits first, then the smallest total
  gib = lambda b: b / GIB
  return {
      "devices": n, "mesh": p.mesh, "grad_accum": accum, "lora_rank": rank, "slots": slots,
      "seq": seq, "snapshots": p.snapshots,
      "train_lora_gib": gib(p.train_peak_bytes_per_device),
      "train_state_gib": gib(p.train_state_bytes_per_device),
      "engine_cache_gib": gib(p.engine_cache_bytes_per_device),
      "kda_slots_gib": gib(p.kda_slots_bytes_per_device),
      "latent_pages_gib": gib(p.latent_pages_bytes_per_device),
      "snapshots_gib": gib(p.snapshots_bytes_per_device),
      "engine_temp_gib": gib(p.engine_temp_bytes_per_device),
      "train_phase_gib": gib(p.train_phase_bytes_per_device),
      "rollout_phase_gib": gib(p.rollout_phase_bytes_per_device),
      "total_gib": gib(p.peak_bytes_per_device), "hbm_gib": gib(p.hbm_bytes_per_device),
      "fits": p.fits, "analytic": True}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="reduced model and steps")
  p.add_argument("--tiny", action="store_true", help="a smoke run of the script (no measurement)")
  p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="bfloat16",
                 help="the RL run's compute dtype (`k3jax rl --dtype`; masters are fp32)")
  p.add_argument("--lora", type=int, default=8, help="LoRA rank of the small model's run")
  p.add_argument("--topologies", default=DEFAULT_TOPOLOGIES,
                 help="slices of the full-K3 memory plan (comma-separated)")
  p.add_argument("--plan-prompts", type=int, default=8, help="(b): prompts per step")
  p.add_argument("--plan-group", type=int, default=8, help="(b): samples per prompt")
  p.add_argument("--plan-seq", type=int, default=8192, help="(b): positions per rollout")
  p.add_argument("--plan-rank", type=int, default=16, help="(b): LoRA rank")
  args = p.parse_args(argv)
  size = TINY if args.tiny else QUICK if args.quick else FULL
  cfg = rl_config(size)
  # MXFP4 packs 32 weights of an expert's input row per scale
  mxfp4 = cfg.latent_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0
  base = "mxfp4" if mxfp4 else "float"
  print(f"platform {jax.default_backend()}, {os.cpu_count()} CPUs; model d={cfg.hidden_size}, "
        f"{cfg.num_layers} layers (MLA at {list(cfg.mla_layers)}), {cfg.num_experts} experts "
        f"top {cfg.num_experts_per_token}, byte vocabulary, bf16 weights; compute "
        f"{args.dtype} over fp32 masters; {size.prompts} prompts x {size.group} samples of "
        f"{size.tokens} tokens a step, {size.steps} steps (the first compiles)", flush=True)

  # (a) step time
  results = {}
  with tempfile.TemporaryDirectory(prefix="k3jax-rl-bench-") as root:
    folder = save_folder(root, cfg, args.seed)
    data = write_prompts(root, 64, args.seed)
    runs = {"full": {}, "lora": {"lora_rank": args.lora, "base_experts": base}}
    for name, kw in runs.items():
      results[name] = summary(run_rl(name, folder, data, root, size, args.dtype, args.seed,
                                     **kw))
  timed = results["full"]["timed_steps"]
  print(f"(a) seconds per RL step, median of {timed} steps after the first "
        f"({size.prompts * size.group} rollouts of {results['full']['completion_len']:.0f} "
        "tokens)")
  print(f"  {'':<26} {'rollout':>8} {'reward':>8} {'reference':>10} {'train':>8} "
        f"{'total':>8} {'gen tok/s':>10} {'first step':>11}")
  labels = {"full": "full fine-tuning",
            "lora": f"LoRA r={args.lora} ({'MXFP4' if mxfp4 else 'float'} base)"}
  for name, label in labels.items():
    r, s = results[name], results[name]["step_s"]
    print(f"  {label:<26} {s['rollout']:>8.3f} {s['reward']:>8.3f} {s['reference']:>10.3f} "
          f"{s['train']:>8.3f} {s['total']:>8.3f} {r['tokens_per_s']:>10.1f} "
          f"{r['first_step_s']:>10.1f}s")

  # (b) the memory plan of LoRA RL on the full K3
  slots = args.plan_prompts * args.plan_group
  print(f"(b) LoRA RL on full K3, per device, ANALYTIC (k3jax.plan, no compile): "
        f"{args.plan_prompts} prompts x {args.plan_group} samples = {slots} rollouts of "
        f"{args.plan_seq} positions, LoRA r={args.plan_rank} over the MXFP4 base; GiB")
  print(f"  {'slice':<14} {'mesh':<30} {'accum':>5} {'train':>7} {'cache':>7} "
        f"{'(KDA/latent/snap)':>20} {'rollout':>8} {'total':>7} {'HBM':>6}  fits")
  plans = {}
  for topology in args.topologies.split(","):
    t0 = time.perf_counter()
    try:
      m = plans[topology] = rl_memory(topology, slots, args.plan_seq, args.plan_rank)
    except Exception as e:  # noqa: BLE001 - report and go on to the next slice
      print(f"  {topology:<14} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
      continue
    split = f"{m['kda_slots_gib']:.1f}/{m['latent_pages_gib']:.1f}/{m['snapshots_gib']:.1f}"
    print(f"  {topology:<14} {m['mesh']:<30} {m['grad_accum']:>5} {m['train_lora_gib']:>7.1f} "
          f"{m['engine_cache_gib']:>7.1f} {split:>20} {m['rollout_phase_gib']:>8.1f} "
          f"{m['total_gib']:>7.1f} {m['hbm_gib']:>6.1f}  {'yes' if m['fits'] else 'NO'} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
  print("  train: the LoRA train step's peak (state + temporaries); cache: the engine's KDA "
        "slots, latent pages and prefix snapshots; rollout: state + cache + the engine step's "
        "temporaries; total: max(train + cache, rollout)")
  if args.json:
    print(json.dumps({
        "step_s": {k: v["step_s"] for k, v in results.items()},
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in results.items()},
        "first_step_s": {k: v["first_step_s"] for k, v in results.items()},
        "timed_steps": timed, "lora_rank": args.lora, "lora_base_experts": base,
        "model": {"hidden": cfg.hidden_size, "layers": cfg.num_layers,
                  "experts": cfg.num_experts, "dtype": args.dtype},
        "rl": {"prompts": size.prompts, "group": size.group, "max_new_tokens": size.tokens,
               "steps": size.steps},
        "plan": plans, "quick": args.quick, "tiny": args.tiny}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
