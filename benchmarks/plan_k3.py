"""The full K3 train step planned for TPU pods: `k3jax plan` over v5p and tpu7x topologies.

For each topology (smallest first) the real train step (fp32 master weights, bf16 compute,
Per-Head Muon; the step flags given fixed, the others chosen by the plan's settings search,
docs/plan.md#choosing-the-settings) is compiled ahead of time on this CPU machine (libtpu),
and XLA's per-device memory plan and cost analysis
are printed next to the chip's HBM and the model FLOPs, with the bytes each device sends in
the collectives (by kind and mesh axis) and the step-time and MFU bounds they give
(docs/plan.md#communication); the first topology with a fitting mesh ends the search for that
chip. An analytic pass (no compile) orders the meshes. Slow (minutes
per compile at full K3 size): a script, not a test.

    python benchmarks/plan_k3.py [--seq 8192] [--remat full] [--loss-chunk 2048] [--grad-accum A]
        [--topologies v5p:8x8x16,tpu7x:8x8x8] [--global-batch 512 | --batch-per-device N]
        [--analytic] [--lora RANK]

The default global batch is the issue's: 512 sequences of 8192 (4M tokens), one row per
batch shard on a 1024-chip pod split fsdp=512 x tensor=2 (tensor splits heads, not rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from k3jax import plan
from k3jax.execution import Attention, Remat

DEFAULT_TOPOLOGIES = ("v5p:8x8x8", "v5p:8x8x16", "v5p:8x16x16", "tpu7x:8x8x4", "tpu7x:8x8x8",
                      "tpu7x:8x8x16")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="k3")
  p.add_argument("--seq", type=int, default=8192)
  chosen = " (default: chosen by the plan)"
  p.add_argument("--remat", default=None, choices=[r.value for r in Remat], help=chosen)
  p.add_argument("--loss-chunk", type=int, default=None, help="0: whole logits" + chosen)
  p.add_argument("--attention", default=None, choices=[a.value for a in Attention], help=chosen)
  p.add_argument("--capacity-factor", type=float, default=None,
                 help="experts' capacity factor (0: dropless)" + chosen)
  p.add_argument("--global-batch", type=int, default=512, help="sequences per step")
  p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step" + chosen)
  p.add_argument("--batch-per-device", type=int, default=None,
                 help="instead of --global-batch: rows per device (global = this x devices)")
  p.add_argument("--topologies", default=",".join(DEFAULT_TOPOLOGIES))
  p.add_argument("--max-compiles", type=int, default=None,
                 help="compile the best N (default: the best, the next if refused)")
  p.add_argument("--analytic", action="store_true", help="no compile")
  p.add_argument("--mesh", default=None, help="one mesh for every topology (default: search)")
  p.add_argument("--lora", type=int, default=None, metavar="RANK",
                 help="plan LoRA fine-tuning of this rank over an MXFP4 base (--mode lora)")
  a = p.parse_args()

  for topology in a.topologies.split(","):
    n = len(plan.topology_devices(topology))
    request = plan.PlanRequest(
        config=a.config, topology=topology, mesh=a.mesh,
        batch=n * a.batch_per_device if a.batch_per_device else a.global_batch,
        seq=a.seq, grad_accum=a.grad_accum, remat=a.remat, loss_chunk=a.loss_chunk,
        attention=a.attention, analytic=a.analytic, capacity_factor=a.capacity_factor,
        max_compiles=a.max_compiles,
        **({"mode": plan.Mode.LORA, "lora_rank": a.lora} if a.lora else {}))
    t0 = time.perf_counter()
    try:
      plans = plan.run(request)
    except Exception as e:  # noqa: BLE001 - report and go on to the next topology
      print(f"{topology}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
      continue
    for pl in plans:
      print(pl.report())
    chosen = plan.best(plans)
    print(f"{topology}: best mesh {chosen.mesh}, fits={chosen.fits} "
          f"({time.perf_counter() - t0:.0f} s)")
    if chosen.collective_bytes_per_device is not None:  # compiled: the communication too
      print(f"{topology}: collectives per device per step: " + ", ".join(
          f"{k} {v / 2**30:.2f} GiB" for k, v in chosen.collective_bytes_per_device.items())
          + (f"; step {chosen.step_seconds[0]:.2f} - {chosen.step_seconds[1]:.2f} s, MFU "
             f"{chosen.mfu[0]:.1%} - {chosen.mfu[1]:.1%} (ESTIMATE: overlapped - not)"
             if chosen.step_seconds else ""))
    if chosen.train_args:
      print(f"{topology}: train with: k3jax train " + " ".join(chosen.train_args))
    print("json:", json.dumps(chosen.to_json()))
    sys.stdout.flush()


if __name__ == "__main__":
  main()
