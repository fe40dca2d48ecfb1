"""`k3jax plan` on a K3-shaped model (K3's widths and vocabulary, 2 layers, 32 experts)
compiled ahead of time for a v5e 2x2 topology (libtpu on the CPU; no TPU): its JSON against
bounds counted independently from the parameter shapes, and the analytic mode against it.

At K3's widths the train state alone (fp32 weights, Muon momentum, AdamW moments: >= 8 bytes
a parameter) of even this 2-layer model exceeds 4 x 16 GiB, so the TPU compiler refuses the
program and reports its temporaries: the plan must say it does not fit."""

import json
import math
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")

from configs import k3
from k3jax.cli import main
from k3jax.train import flops

GIB = 1024**3
# every step flag given: no settings search, the plan of this one setting (fits or not)
ARGS = ["--topology", "v5e:2x2", "--mesh", "fsdp=2,tensor=2", "--batch", "4", "--seq", "256",
        "--remat", "full", "--loss-chunk", "128", "--grad-accum", "1", "--attention", "dense",
        "--capacity-factor", "0", "--json"]


def _param_count(cfg) -> int:
  """Parameters counted from the model's abstract shapes (nothing allocated)."""
  import jax
  from flax import nnx

  from k3jax.model.transformer import K3Model
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _plan(capsys, path, *extra):
  assert main(["plan", "--config", path, *ARGS, *extra]) == 0
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plan_compiled_and_analytic(config_file, capsys):
  path, cfg = config_file
  n_dev = 4
  params = _param_count(cfg)
  fp32_per_device = params * 4 / n_dev  # every large matrix is split 4 ways by this mesh

  got = _plan(capsys, path)
  assert got["hbm_bytes_per_device"] == 16 * GIB
  assert got["param_count"] == params
  assert got["model_flops"] > 0 and got["compile_seconds"] > 0
  # the state: weights + Muon momentum (matrices) or two AdamW moments (embedding, norms)
  assert 2 * fp32_per_device <= got["argument_bytes_per_device"] <= 3.05 * fp32_per_device
  # XLA's temporaries hold at least the fp32 gradients (all live at the global-norm clip)
  assert got["temp_bytes_per_device"] >= 0.99 * fp32_per_device
  assert got["peak_bytes_per_device"] >= got["argument_bytes_per_device"]
  assert got["fits"] is False and got["peak_bytes_per_device"] > 16 * GIB
  assert got["fits"] == (got["peak_bytes_per_device"] <= got["hbm_bytes_per_device"])
  # refused by the compiler: no program to read collectives from, so no bounds either
  for key in ("collective_bytes_per_device", "collective_bytes_per_axis", "step_seconds",
              "mfu"):
    assert key in got and got[key] is None

  ana = _plan(capsys, path, "--analytic")
  assert ana["analytic"] is True and ana["compile_seconds"] is None
  # arguments are the sharded state's shapes in both: equal to a byte (plus the batch)
  assert abs(ana["argument_bytes_per_device"] - got["argument_bytes_per_device"]) <= 1 << 20
  # the hand count of temporaries is a cross-check, within a factor of 2 of XLA's
  ratio = ana["temp_bytes_per_device"] / got["temp_bytes_per_device"]
  assert 0.5 <= ratio <= 2.0, ratio
  assert ana["fits"] == got["fits"]
  assert ana["model_flops"] == got["model_flops"]


def test_plan_bad_topology(capsys):
  assert main(["plan", "--config", "tiny", "--topology", "v99:2x2", "--analytic"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--topology" in err[0] and "v5p:8x8x16" in err[0]


def test_plan_lora_holds_a_frozen_bf16_base_and_mxfp4_experts(config_file, capsys):
  """`--mode lora` (analytic: the argument bytes are the sharded state's shapes, as compiled):
  the frozen base in bf16 (2 bytes a parameter), the routed experts as MXFP4 codes + scales
  (0.5 + 1/32), the adapters with fp32 master, gradient-free AdamW moments (16); the same
  count from the parameter shapes, a fifth of the full train state's bytes or less."""
  import jax
  from flax import nnx

  from k3jax.model import lora
  from k3jax.model.transformer import K3Model
  path, cfg = config_file
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  experts = dense = 0
  for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    n = math.prod(v.shape)
    if tuple(map(str, p[:2])) == ("moe", "experts"):
      experts += n
    else:
      dense += n
  spec = lora.AdaptSpec(rank=16)
  adapted = nnx.eval_shape(lambda: lora.adapt(K3Model(cfg, rngs=nnx.Rngs(0)), spec,
                                              nnx.Rngs(1)))
  adapters = sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam)))
  # the large matrices are split 4 ways by fsdp=2 x tensor=2; some only 2 ways (the latent-
  # width projections, MXFP4 scales: < 5% of the base's bytes here), and an adapter factor
  # at most replicated
  base = 2 * dense + (0.5 + 1 / 32) * experts
  low, high = (base + 16 * adapters) / 4, 1.05 * base / 4 + 16 * adapters

  train = _plan(capsys, path, "--analytic")
  got = _plan(capsys, path, "--analytic", "--mode", "lora", "--lora", "16")
  assert got["mode"] == "lora" and got["lora_rank"] == 16
  assert got["trainable_param_count"] == adapters
  assert got["param_count"] == dense + experts + adapters
  assert low <= got["state_bytes_per_device"] <= high, (got, low, high)
  assert got["state_bytes_per_device"] < train["state_bytes_per_device"] / 5
  # no weight gradient for the frozen base: forward 2N + activation gradient 2N of 6N
  assert got["model_flops"] == pytest.approx(train["model_flops"] * 2 / 3, rel=1e-12)
  # full remat recomputes the forward: a third of training's model FLOPs, half of LoRA's;
  # Newton-Schulz only where Per-Head Muon runs (full training)
  assert train["remat_flops"] == pytest.approx(train["model_flops"] / 3, rel=1e-12)
  assert got["remat_flops"] == pytest.approx(train["remat_flops"], rel=1e-12)
  assert train["optimizer_flops"] > 0 and got["optimizer_flops"] == 0
  # save-attention recomputes the forward but MLA's attention (batch 4 x seq 256)
  kept = _plan(capsys, path, "--analytic", "--remat", "save-attention", "--attention", "flash")
  attention = flops.count(cfg, 256).mla_attention * 4 * 256
  assert attention > 0
  assert kept["remat_flops"] == pytest.approx(train["remat_flops"] - attention, rel=1e-12)
  # refused: nothing to keep without the flash kernels
  assert main(["plan", "--config", path, *ARGS, "--analytic", "--remat", "save-attention"]) != 0
  assert "remat save-attention keeps the flash kernels' output: it needs attention flash, not " \
         "dense" in capsys.readouterr().err
  assert main(["plan", "--config", path, *ARGS, "--analytic", "--mode", "lora",
               "--lora", "0"]) == 2
  assert "--lora RANK must be > 0" in capsys.readouterr().err


def test_analytic_counts_one_moe_layer_on_the_mesh():
  """The analytic count's MoE term (k3jax/plan/analytic.moe_layer_bytes) on K3 at 512 x 8192 tokens,
  from the expert-parallel layout: on fsdp=512 x tensor=2 (896 experts do not split over expert x
  fsdp) a layer all-gathers all 896 experts over fsdp (bf16, F split by tensor; x 2 with the
  backward's gradient): the term that brings the hand count of temporaries for this mesh
  (107.6 GiB) near the 111.3 GiB the TPU compiler reports for the full K3 step; the dropless
  receive buffer holds every local pair (8192 tokens x 16); a capacity factor bounds the buffer
  on an expert-parallel mesh."""
  import jax

  from k3jax.plan import PlanRequest
  from k3jax.plan import analytic as plan_analytic
  from k3jax.plan.train import train_execution
  cfg, ex = k3.config(), train_execution(PlanRequest(config="k3", topology="v5p:8x16x16"))
  l, f = cfg.latent_size, cfg.moe_intermediate_size
  fsdp = jax.sharding.AbstractMesh((1, 512, 1, 2), ("data", "fsdp", "expert", "tensor"))
  gathered = 2 * 896 * 3 * l * (f // 2) * 2
  assert plan_analytic.moe_layer_bytes(cfg, ex, fsdp, 512 * 8192) == (
      gathered + 3 * 8192 * 16 * l * 2)
  ep = jax.sharding.AbstractMesh((1, 4, 128, 2), ("data", "fsdp", "expert", "tensor"))
  dropless = plan_analytic.moe_layer_bytes(cfg, ex, ep, 512 * 8192)
  bounded = plan_analytic.moe_layer_bytes(cfg, ex.replace(moe_capacity_factor=1.25), ep,
                                          512 * 8192)
  # 7 local experts each taking <= ceil(1.25 x 16 x 128 x 8192 / 896) pairs, not 128 x 8192 x 7;
  # the rows rounded up to a multiple of 128 (whole row tiles of the megablox kernels, and a
  # multiple of the 8 that XLA:TPU's ragged_dot kernel takes)
  capacity = -(-int(1.25 * 16 * 128 * 8192) // 896)
  rows = -(-7 * capacity // 128) * 128
  assert rows == 163968  # from 163,842
  assert bounded - (dropless - 3 * 128 * 8192 * 7 * l * 2) == 3 * rows * l * 2
