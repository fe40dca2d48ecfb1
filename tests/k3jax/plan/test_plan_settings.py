"""The settings search of `k3jax plan` (k3jax/plan/settings.py) on the K3-shaped 2-layer model
(K3's widths, 32 experts) for a v5e 2x2 topology: the setting it chooses is the fastest that an
exhaustive loop over explicit flags finds, explicit flags stay, the chosen plan is compiled once
and its `train_args` are flags `k3jax train` accepts and runs the same step with, and a batch
that fits no setting is a one-line error naming one that does."""

import json
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="libtpu is needed to compile for TPU ahead of time")

import itertools
from types import SimpleNamespace

import configs
from k3jax import plan
from k3jax.cli import build_parser, main
from k3jax.commands.train import options_from_args
from k3jax.execution import Remat
from k3jax.plan import settings, train
from k3jax.train.loop import execution

TOPOLOGY, MESH = "v5e:2x2", "fsdp=2,tensor=2"
LORA_MARGIN = settings.MARGIN[plan.Mode.LORA]


def _request(path, **kw):
  base = dict(config=path, topology=TOPOLOGY, mesh=MESH, mode="lora", analytic=True)
  return plan.PlanRequest(**{**base, **kw})


def test_search_chooses_the_fastest_setting_that_fits(config_file, capsys):
  """LoRA, 8 rows x 4096: the defaults do not fit the LoRA margin of the 16 GiB; the search's
  choice equals the best of every explicit (grad-accum, remat, loss-chunk) combination planned
  one by one, ranked by the same rule (estimated step time, then the smallest peak); the
  given --attention and --capacity-factor stay as given."""
  path, _ = config_file
  fixed = dict(batch=8, seq=4096, attention="flash", capacity_factor=0)
  chosen = plan.best(plan.run(_request(path, **fixed)))
  err = capsys.readouterr().err
  assert "18 settings counted" in err  # 3 remat x 2 loss chunks x accum {1, 2, 4}
  assert chosen.attention == "flash" and "--capacity-factor" not in chosen.train_args

  default = plan.run(settings.with_defaults(_request(path, **fixed)))[0]
  assert default.peak_bytes_per_device > LORA_MARGIN * default.hbm_bytes_per_device

  every = []
  for accum, remat, chunk in itertools.product((1, 2, 4), list(Remat)[:3], (0, 2048)):
    if remat == Remat.OFFLOAD:
      continue
    p = plan.run(_request(path, **fixed, grad_accum=accum, remat=remat, loss_chunk=chunk))[0]
    if p.peak_bytes_per_device <= LORA_MARGIN * p.hbm_bytes_per_device:
      every.append(p)
  assert every
  best = min(every, key=lambda p: (p.step_seconds[1], p.peak_bytes_per_device))
  assert (chosen.grad_accum, chosen.remat, chosen.loss_chunk) == (
      best.grad_accum, best.remat, best.loss_chunk)
  assert chosen.peak_bytes_per_device == best.peak_bytes_per_device
  # several fit, and the search did not take the first that fits
  assert len(every) > 1 and chosen.step_seconds[1] <= min(p.step_seconds[1] for p in every)


def _check_train_args(got: dict) -> None:
  """`train_args` parse with `k3jax train`'s own parser into the execution (remat, attention,
  loss chunk, capacity), batch, mesh and LoRA the plan planned."""
  args = build_parser().parse_args(["train", *got["train_args"], "--out", "/nonexistent"])
  opts = options_from_args(args)
  ex = execution(opts)
  assert (opts.batch_size, opts.seq_len, opts.grad_accum) == (
      got["batch"], got["seq"], got["grad_accum"])
  assert opts.mesh == got["mesh"] and opts.lora_rank == got["lora_rank"] == 16
  assert ex.remat.value == got["remat"] and ex.attention.value == got["attention"]
  assert ex.loss_chunk == got["loss_chunk"] and ex.dtype == "bfloat16"
  assert ex.moe_capacity_factor is None  # dropless fits here, and is preferred


def test_search_without_step_flags_gives_train_flags(config_file, capsys):
  """No step flag (analytic): the choice carries the `k3jax train` flags that run it, and the
  text report prints them as a command line."""
  path, _ = config_file
  cmd = ["plan", "--config", path, "--topology", TOPOLOGY, "--mesh", MESH, "--mode", "lora",
         "--batch", "4", "--seq", "256", "--analytic"]
  assert main([*cmd, "--json"]) == 0
  got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert got["fits"] is True and got["train_args"][:2] == ["--config", path]
  _check_train_args(got)
  assert main(cmd) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert line.startswith("train with: k3jax train --config ") and "--lora 16" in line


def test_compiles_in_rank_order_until_one_fits():
  """The compile step (settings._compile) with a stand-in planner: the best candidate, the
  next only after a refusal; --max-compiles N compiles the best N whatever fits."""
  ranked = [SimpleNamespace(request=i, plan=SimpleNamespace(mesh="fsdp=2",
                                                            peak_bytes_per_device=1))
            for i in range(5)]
  calls = []

  def plan_one(request, sizes, analytic, refused=(0,)):
    assert analytic is False and sizes == {"fsdp": 2}
    calls.append(request)
    return SimpleNamespace(fits=request not in refused, compile_oom=request in refused,
                           peak_bytes_per_device=2, compile_seconds=1.0)

  plans = settings._compile(ranked, None, plan_one, lambda line: None)
  assert calls == [0, 1] and [p.fits for p in plans] == [False, True]
  calls.clear()
  assert len(settings._compile(ranked, 3, plan_one, lambda line: None)) == 3
  assert calls == [0, 1, 2]
  calls.clear()
  never = lambda request, sizes, analytic: plan_one(request, sizes, analytic, range(5))
  plans = settings._compile(ranked, None, never, lambda line: None)
  assert calls == [0, 1, 2] and not any(p.fits for p in plans)  # at most RETRIES tries


@pytest.mark.long
def test_search_compiles_the_choice_once(config_file, capsys):
  """No step flag, compiled: the chosen setting is compiled once and fits; its flags run."""
  path, _ = config_file
  assert main(["plan", "--config", path, "--topology", TOPOLOGY, "--mesh", MESH, "--mode",
               "lora", "--batch", "4", "--seq", "256", "--json"]) == 0
  out, err = capsys.readouterr()
  got = json.loads(out.strip().splitlines()[-1])
  assert err.count("compiling ") == 1 and got["analytic"] is False and got["fits"] is True
  assert got["peak_bytes_per_device"] <= got["hbm_bytes_per_device"]
  _check_train_args(got)
  # the compiled plan reads its communication from the program
  assert sum(got["collective_bytes_per_device"].values()) > 0
  assert got["step_seconds"][0] <= got["step_seconds"][1]


def test_nothing_fits_names_the_nearest_batch(config_file, capsys):
  """A batch no setting fits: one line naming the smallest peak and the largest batch that
  fits with its settings, which an explicit plan confirms; full training of this model fits
  no batch at all (its state alone is most of the HBM): the line says so."""
  path, _ = config_file
  base = ["plan", "--config", path, "--topology", TOPOLOGY, "--mesh", MESH, "--seq", "4096",
          "--analytic", "--attention", "flash", "--loss-chunk", "2048", "--capacity-factor",
          "0"]
  assert main([*base, "--mode", "lora", "--batch", "64", "--grad-accum", "1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 2 and "fits no setting" in err[-1], err  # the search's line, the error
  nearest = int(err[-1].split("; --batch ")[1].split()[0])
  assert 0 < nearest < 64
  remat = err[-1].split("--remat ")[1].split()[0] if "--remat " in err[-1] else "none"
  assert main([*base, "--mode", "lora", "--batch", str(nearest), "--grad-accum", "1",
               "--remat", remat, "--json"]) == 0
  fits = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert fits["peak_bytes_per_device"] <= LORA_MARGIN * fits["hbm_bytes_per_device"]

  assert main(["plan", "--config", path, "--topology", TOPOLOGY, "--mesh", MESH, "--batch",
               "4", "--seq", "256", "--analytic"]) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "fits no setting" in err and "a larger topology, or --mode lora" in err


def test_long_sequences_are_planned_on_meshes_with_a_context_axis():
  """At a million positions the train plan's candidate meshes split them over `context`, each
  device keeping 4,096 to 32,768 positions of whole KDA chunks, with batch axes that divide
  the rows; at 8,192 positions none does. Without --batch a long sequence gets the rows of
  8,192 positions per device."""
  cfg = configs.get("k3")
  meshes = train.candidate_meshes(cfg, 1024, 8, 1 << 20)
  assert meshes and all(m.get("context", 1) > 1 for m in meshes)
  for m in meshes:
    assert 4096 <= (1 << 20) // m["context"] <= 32768 and (1 << 20) % (m["context"] * 64) == 0
    assert 8 % (m["data"] * m["fsdp"] * m["expert"]) == 0
    assert m["data"] * m["fsdp"] * m["expert"] * m["context"] * m["tensor"] == 1024
  assert not any("context" in m for m in train.candidate_meshes(cfg, 1024, 1024, 8192))
  assert plan.DEFAULT_TOKENS_PER_DEVICE * 1024 // (1 << 20) == 8
