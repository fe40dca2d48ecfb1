"""`k3jax plan --mode decode` on a K3-shaped model (K3's widths and vocabulary, 2 layers: one
KDA, one MLA; 32 experts) compiled ahead of time for a v5e 2x2 topology (libtpu on the CPU):
the weights and the cache per device against counts made here from the config, the compiled
decode step's FLOPs against the hand count of one token per row, and the analytic mode
against the compiled figures."""

import json
import math
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")

from k3jax.cli import main

GIB = 1024**3
ROWS, SEQ, CHUNK = 4, 512, 128
ARGS = ["--topology", "v5e:2x2", "--mode", "decode", "--batch", str(ROWS), "--seq", str(SEQ),
        "--prefill-chunk", str(CHUNK), "--json"]


def _plan(capsys, path, *extra):
  assert main(["plan", "--config", path, *ARGS, *extra]) == 0
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _param_count(cfg) -> int:
  import jax
  from flax import nnx

  from k3jax.model.transformer import K3Model
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(model)))


def _cache_bytes(cfg, tensor: int) -> int:
  """One device's cache on a tensor-only mesh, from the config (docs/inference.md): the KDA
  recurrent state [B, H, K, V] fp32 and conv tails [B, taps - 1, H, K] x 3 in bf16 split over tensor
  by heads; the MLA latent and shared key [B, S, kv_lora + rope] in bf16 whole on every device
  (no head axis); 4-byte start per row and the length."""
  h, k = cfg.kda_num_heads // tensor, cfg.kda_head_dim
  n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
  kda = n_kda * ROWS * (h * k * k * 4 + 3 * (cfg.conv_kernel_size - 1) * h * k * 2)
  mla = n_mla * ROWS * SEQ * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
  return kda + mla + ROWS * 4 + 4


@pytest.mark.long
def test_decode_plan_compiled_and_analytic(config_file, capsys):
  from k3jax.train import flops
  path, cfg = config_file
  params = _param_count(cfg)

  got = _plan(capsys, path, "--mesh", "tensor=4")
  assert got["mode"] == "decode" and got["param_count"] == params
  assert got["hbm_bytes_per_device"] == 16 * GIB
  # bf16 weights, the large matrices split 4 ways by heads / widths; whole on each device:
  # what only fsdp splits (MLA's q_a / kv_a, the latent up / down projections: 1.3% of the
  # bytes here), the norms, biases and the router
  assert params * 2 / 4 <= got["weight_bytes_per_device"] <= 1.05 * params * 2 / 4
  assert got["cache_bytes_per_device"] == _cache_bytes(cfg, 4)
  # the programs hold the weights and the cache, plus their temporaries
  assert got["peak_bytes_per_device"] >= (got["weight_bytes_per_device"]
                                          + got["cache_bytes_per_device"])
  assert got["fits"] is True and got["compile_oom"] is False
  # one decode step: every row one token attending to SEQ positions (XLA counts the while
  # loop's body once). The hand count prices KDA at its chunked form's FLOPs, the fused
  # decode step does fewer; the matmuls (> 90% of the count) are the same work (XLA 0.12:
  # 1.08 with ragged_dot experts; 1.17 with megablox's, whose static cost estimate counts the
  # 4 x 16 pairs padded to one 128-row tile). Running all 32 experts for every row instead of
  # its 16 would add the routed experts' share again (16% of this model's count): the upper
  # bound catches that
  model = ROWS * flops.decode_per_token(cfg, SEQ)
  assert got["model_flops"] == pytest.approx(model, rel=1e-12)
  assert 0.8 <= got["flops_ratio"] <= 1.2, got["flops_ratio"]
  # a decode step reads at least every weight byte once (the 32 experts of 4 rows x 16
  # routed pairs are nearly all touched) and the cache
  assert got["compiled_bytes_accessed"] >= 0.9 * 4 * got["weight_bytes_per_device"]
  assert got["tokens_per_second_estimate"] == pytest.approx(
      ROWS / got["step_seconds_estimate"], rel=1e-12)

  ana = _plan(capsys, path, "--mesh", "tensor=4", "--analytic", "--serving", "static")
  assert ana["analytic"] is True and ana["compile_seconds"] is None
  for key in ("weight_bytes_per_device", "cache_bytes_per_device", "model_flops"):
    assert ana[key] == got[key], key
  # the hand-counted temporaries are a cross-check: the peak within a quarter of XLA's
  ratio = ana["peak_bytes_per_device"] / got["peak_bytes_per_device"]
  assert 0.8 <= ratio <= 1.25, ratio
  assert ana["fits"] == got["fits"]


def test_decode_mesh_search_and_bad_batch(config_file, capsys):
  """Without --mesh the analytic search ranks serving meshes: what fits first, then by the
  estimated tokens/s; every candidate splits the rows over its batch axes. A batch the mesh
  cannot split is one line and exit 2."""
  path, _ = config_file
  assert main(["plan", "--config", path, *ARGS, "--analytic"]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  cands = out["candidates"]
  assert len(cands) >= 2 and all(c["analytic"] for c in cands)
  assert out["fits"] and out["mesh"] == cands[0]["mesh"]
  rates = [c["tokens_per_second_estimate"] for c in cands if c["fits"]]
  assert rates == sorted(rates, reverse=True)
  # more weight bytes per device where tensor splits less: weights are read per step
  by_tensor = {int(c["mesh"].split("tensor=")[1]): c["weight_bytes_per_device"] for c in cands}
  assert by_tensor[4] < by_tensor[min(by_tensor)]

  assert main(["plan", "--config", path, *ARGS[:-1], "--mesh", "data=4", "--batch", "2",
               "--analytic", "--serving", "static"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--batch rows = 2" in err[0], err


# the keys of a decode plan's JSON before it modelled the serving engine: every one stays
OLD_KEYS = {
    "topology", "devices", "mesh", "batch", "seq", "prefill_chunk", "block", "mode", "analytic",
    "hbm_bytes_per_device", "weight_bytes_per_device", "cache_bytes_per_device",
    "prefill_temp_bytes_per_device", "decode_temp_bytes_per_device", "peak_bytes_per_device",
    "fits", "compile_seconds", "compiled_flops", "compiled_bytes_accessed", "model_flops",
    "flops_ratio", "step_seconds_estimate", "tokens_per_second_estimate", "param_count",
    "compile_oom"}


def test_engine_plan_keys_defaults_and_max_fit(config_file, capsys):
  """--analytic plans the serving engine with packed experts by default; the JSON keeps every
  old key and adds the cache's parts, which sum to the cache; --max-fit's batch fits and one
  more slot does not; the engine, packed experts and --max-fit are refused without
  --analytic (one line, exit 2)."""
  path, _ = config_file
  eng = _plan(capsys, path, "--mesh", "tensor=4", "--analytic", "--max-fit")
  static = _plan(capsys, path, "--mesh", "tensor=4", "--analytic", "--serving", "static")
  for plan in (eng, static):
    assert OLD_KEYS <= set(plan), OLD_KEYS - set(plan)
  assert (eng["serving"], eng["experts"]) == ("engine", "mxfp4")
  assert (static["serving"], static["experts"]) == ("static", "dequantized")
  assert eng["cache_bytes_per_device"] == (eng["kda_slot_bytes_per_device"]
                                           + eng["latent_page_bytes_per_device"]
                                           + eng["snapshot_bytes_per_device"])
  assert eng["pool_pages"] == ROWS * SEQ // eng["page_size"] and eng["snapshots"] == 2 * ROWS
  # packed experts: fewer weight bytes, the same parameters
  assert eng["weight_bytes_per_device"] < static["weight_bytes_per_device"]
  assert eng["param_count"] == static["param_count"]
  best = eng["max_fit_batch"]
  assert best > ROWS
  for rows, fits in ((best, True), (best + 1, False)):
    got = _plan(capsys, path, "--mesh", "tensor=4", "--analytic", "--batch", str(rows))
    assert got["fits"] is fits and got["max_fit_batch"] is None

  for extra in ((), ("--serving", "static", "--experts", "mxfp4"), ("--serving", "static",
                                                                     "--max-fit")):
    assert main(["plan", "--config", path, *ARGS, "--mesh", "tensor=4",
                 *([] if extra else ["--serving", "engine"]), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--analytic" in err[0], err


def test_million_positions_fit_only_with_pages_over_context(config_file, capsys):
  """`--mode decode --seq 1048576 --max-fit` on v5e:2x2: the engine's candidate meshes also
  spread the latent pages by position over `context` (a device holding 1 / context of them
  and attending over 1 / context of each row's positions), and are ranked by the most slots
  that fit at --seq. With a prefill chunk of 64 no mesh without a context axis holds one
  1M-position slot of the K3-shaped model (16 GiB per device), context=4 holds two."""
  path, _ = config_file
  assert main(["plan", "--config", path, "--topology", "v5e:2x2", "--mode", "decode",
               "--seq", str(1 << 20), "--batch", "1", "--prefill-chunk", "64", "--analytic",
               "--max-fit", "--json"]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  cands = out["candidates"]
  slots = [c["max_fit_batch"] for c in cands]
  assert slots == sorted(slots, reverse=True) and out["mesh"] == cands[0]["mesh"]
  by_context = {}
  for c in cands:
    sizes = dict(kv.split("=") for kv in c["mesh"].split(","))
    assert c["context_shards"] == int(sizes["context"])
    by_context.setdefault(c["context_shards"], []).append(c)
  assert set(by_context) == {1, 2, 4}
  assert all(c["max_fit_batch"] == 0 and not c["fits"] for c in by_context[1])
  assert out["context_shards"] == 4 and out["max_fit_batch"] >= 2 and out["fits"]
  # a device's latent pages of the one slot: fewer the more devices they spread over
  pages = {n: min(c["latent_page_bytes_per_device"] for c in cs) for n, cs in by_context.items()}
  assert pages[4] < pages[2] < pages[1]
