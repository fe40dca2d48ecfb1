"""LoRA fine-tuning end to end on k3_tiny_a (the released layout, MXFP4 experts): adapters on
MLA and per routed expert over MXFP4-packed frozen experts with QAT. The base stays bit for
bit what it was, only adapters hold optimizer state, the loss falls, checkpoints hold the
adapters and a reference to the base (not the base), a resume rebuilds the base and goes on
exactly as the straight run, a changed or missing base is refused, and `k3jax export
--merge-lora` writes base + scale * A B (float64, then the official dtypes) whose loaded model
computes the trained model's logits (float64)."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

from convert import fingerprint, orbax_io, safetensors_io
from convert.hf_load import load_model
from convert.lora_export import ADAPTER_CONFIG, ADAPTER_FILE, is_adapter
from k3jax.cli import main
from k3jax.errors import UserError
from k3jax.execution import Execution
from k3jax.info import param_breakdown
from k3jax.model import lora
from k3jax.train import checkpoint as ckpt_lib
from k3jax.train import frozen_base
from k3jax.train import step as step_lib
from k3jax.train.loop import adapt_spec, run, step_config
from k3jax.train.metrics import read_records
from pallas_kernels import mxfp4 as mx

from .helpers import MICRO, options

STEPS = 12
TARGETS = ("mla.*", "moe.experts.*")


def conversations(n):
  """Chat turns with fixed phrasing (the chat SFT test's sums), as plain text: k3_tiny_a has
  256 embeddings, so it trains byte-level (a chat template's special tokens would not fit)."""
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(n):
    a, b = (int(x) for x in rng.integers(0, 50, 2))
    rows.append(f"user: What is {a} plus {b}?\nassistant: {a} plus {b} is {a + b}.\n")
  return "".join(rows)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_dir):
  tmp = tmp_path_factory.mktemp("lora")
  data = tmp / "sums.txt"
  data.write_text(conversations(400))
  # a writable copy: the tampering test changes it (and puts it back)
  base = str(tmp / "k3_tiny_a")
  shutil.copytree(os.path.join(reference_dir, "k3_tiny_a"), base,
                  copy_function=shutil.copyfile)
  os.chmod(base, 0o755)
  opts = options(tmp / "run", None, init_from=base, data=str(data), steps=STEPS,
                 decay_steps=STEPS, warmup_steps=2, seq_len=64, eval_every=STEPS,
                 save_every=STEPS // 2, plots=False, tensorboard=False, learning_rate=1e-2,
                 lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS, base_experts="mxfp4",
                 experts_qat=True)
  summary = run(opts)
  return opts, summary, base


def saved_arrays(directory):
  return {p: np.asarray(orbax_io.open_array(directory, p).read().result())
          for p in orbax_io.saved_paths(directory)}


def test_lora_run_trains_adapters_only(trained):
  opts, summary, base = trained
  ex_run = Execution(param_dtype="float32", dtype="float32")
  model, cfg = load_model(base, ex_run)
  spec = adapt_spec(opts, cfg)
  _, params, bias = step_lib.split_model(model)
  start = step_lib.adapt_params(cfg, ex_run, params, bias, spec, opts.seed)
  start_flat = {tuple(str(k.key) for k in p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(start)[0]}
  saved = saved_arrays(os.path.join(summary["out"], "model"))
  adapters = {p for p in start_flat if is_adapter(p)}
  # every base array (packed expert codes included) is bit-identical after the steps
  for path, value in start_flat.items():
    if is_adapter(path):
      continue
    np.testing.assert_array_equal(saved[path], value, err_msg=".".join(path))
  assert any(p[-1] == "w1_packed" for p in start_flat)
  # the adapters moved, and they are all that is trainable
  n_adapter = sum(v.size for p, v in start_flat.items() if is_adapter(p))
  assert any(not np.array_equal(saved[p], start_flat[p]) for p in adapters)
  # rank 4 on each MLA projection ([in..., out...] -> 4 * (in + out)) and each routed expert
  mla_kernels = {p: v.shape for p, v in start_flat.items() if p[0] == "mla" and p[-1] == "kernel"}
  expected = 0
  for path, shape in mla_kernels.items():
    n_in = 2 if path[1] == "o_proj" else 1
    expected += shape[0] * 4 * (np.prod(shape[1:1 + n_in]) + np.prod(shape[1 + n_in:]))
  n_moe, n_exp = len(cfg.moe_layers), cfg.num_experts
  expected += 3 * n_moe * n_exp * 4 * (cfg.latent_size + cfg.moe_intermediate_size)
  assert summary["trainable_params"] == n_adapter == expected
  # the model's parameters as `k3jax info` counts them, plus the adapters
  assert summary["total_params"] == sum(param_breakdown(cfg).values()) + n_adapter
  # the optimizer holds state for the adapters only: AdamW's two moments, nothing else
  steps = step_lib.build(cfg, ex_run, step_config(opts), spec=spec)
  state = steps.init(start, bias, step_lib.new_rng(0))
  sizes = [x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
  assert sum(sizes) == 2 * n_adapter
  # the loss falls: bytes start near uniform (ln 256 = 5.5 nats); this text's byte
  # frequencies alone are worth > 2 nats of that, a fraction of which 12 steps must find.
  # The same run at learning rate 0 (adapters that never move: the base) ends at train 7.33,
  # eval 7.38 against a first loss of 7.40 (drops 0.08, 0.02); trained, 6.78 and 6.93 (drops
  # 0.62, 0.47 on one x86 CPU; a 0.5 bound on the eval drop failed there and held on another).
  # 0.25 nats sits midway: it tells a run that learns from one that does not, with ~0.2 of
  # margin either side, far above float32 differences between machines.
  assert summary["last_loss"] < summary["first_loss"] - 0.25, summary
  assert summary["eval_loss"] < summary["first_loss"] - 0.25, summary
  # a checkpoint holds the adapters (+ their AdamW moments, biases, step, RNG, data position)
  # and a reference to the base, not the base: every params array in it is an adapter
  ckpt = os.path.join(summary["out"], "checkpoints", str(STEPS))
  in_ckpt = orbax_io.saved_paths(os.path.join(ckpt, "state"))
  assert {p[1:] for p in in_ckpt if p[0] == "params"} == adapters
  assert summary["checkpoints"] == [STEPS // 2, STEPS]
  shards = [f for f in os.listdir(base) if f.endswith(".safetensors")]
  assert summary["base_bytes"] == sum(os.path.getsize(os.path.join(base, f)) for f in
                                      shards + ["config.json", "model.safetensors.index.json"])
  assert summary["checkpoint_bytes"] == sum(
      os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
  # the adapters' fp32 values and two AdamW moments (Orbax compresses them a little) and
  # metadata: no room for the base's 1.26 MB. (Rank 4 on each of this tiny model's experts
  # is about as large as its MXFP4 base; for K3, docs/training.md gives the figures.)
  assert summary["checkpoint_bytes"] < 3 * 4 * n_adapter + 100_000
  assert summary["base_bytes"] > 1_000_000
  # stopped after the first checkpoint and resumed (a copy without the last checkpoint: the
  # export test reads this run's model, and TensorStore caches what it read), the run rebuilds
  # the base from its folder (MXFP4 packing included), restores the adapters and their
  # optimizer state, and computes the straight run's steps bit for bit; the base is still
  # the one it started from
  copy = summary["out"] + "_resumed"
  shutil.copytree(summary["out"], copy)
  shutil.rmtree(os.path.join(copy, "checkpoints", str(STEPS)))
  resumed = run(dataclasses.replace(opts, out=copy))
  assert resumed["start_step"] == STEPS // 2 and resumed["trainable_params"] == n_adapter
  want, got = read_records(summary["out"]), read_records(copy)
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
  for key in ("loss", "grad_norm", "load_max_mean_after"):
    np.testing.assert_array_equal([r[key] for r in got], [r[key] for r in want], err_msg=key)
  assert resumed["eval_loss"] == summary["eval_loss"]
  saved = saved_arrays(os.path.join(copy, "model"))
  straight = saved_arrays(os.path.join(summary["out"], "model"))
  for path, value in start_flat.items():
    np.testing.assert_array_equal(saved[path], straight[path] if is_adapter(path) else value,
                                  err_msg=".".join(path))


def test_a_changed_or_missing_base_is_refused(trained, tmp_path):
  """A resume recomputes the base's fingerprint: a changed header byte, a changed byte in a
  sampled range (same size), a resized file or a missing folder each stop it with one line
  naming the folder and what differs, before anything is loaded; a change outside the
  sampled ranges of a same-size shard is the documented blind spot."""
  opts, summary, base = trained
  out = str(tmp_path / "run")
  shutil.copytree(summary["out"], out)
  resume = dataclasses.replace(opts, out=out, steps=STEPS + 2)
  shard = os.path.join(base, "model-00002-of-00003.safetensors")
  header = safetensors_io.read_header(shard)
  sampled = fingerprint.sampled_ranges(header.data_start, os.path.getsize(shard))
  unsampled = sampled[1][1] + 1  # between the second and the third sampled range
  assert all(not start <= unsampled < stop for start, stop in sampled)

  def refused(offset, what):
    with open(shard, "r+b") as f:
      f.seek(offset)
      old = f.read(1)
      f.seek(offset)
      f.write(bytes([old[0] ^ 0x01]))
    try:
      if what is None:  # not in the fingerprint: the resume would go on
        ckpt = ckpt_lib.Checkpointer(os.path.join(out, "checkpoints"), keep=3)
        ref = ckpt.base_reference(STEPS)
        ckpt.close()
        frozen_base.check(ref, "the checkpoint")
        return
      with pytest.raises(UserError) as e:
        run(resume)
      msg = str(e.value)
      assert "\n" not in msg and msg.startswith(f"{base}: not the base checkpoint {STEPS}")
      assert f"model-00002-of-00003.safetensors: {what}" in msg, msg
    finally:
      with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(old)

  refused(20, "header differs")                       # inside the header's JSON
  refused((sampled[5][0] + sampled[5][1]) // 2, "sampled bytes differ")
  refused(unsampled, None)
  with open(shard, "ab") as f:                        # one byte more
    f.write(b"\0")
  try:
    with pytest.raises(UserError, match="size differs"):
      run(resume)
  finally:
    with open(shard, "r+b") as f:
      f.truncate(os.path.getsize(shard) - 1)
  moved = base + "_moved"
  os.rename(base, moved)
  try:
    with pytest.raises(UserError, match=f"^{base}: the base of the run in {out} is missing"):
      run(resume)
  finally:
    os.rename(moved, base)
  # the refused resumes left the run as it was
  assert sorted(os.listdir(os.path.join(out, "checkpoints")), key=int) == [
      str(STEPS // 2), str(STEPS)]
  assert read_records(out) == read_records(summary["out"])



def test_merged_export_is_base_plus_scaled_adapters_and_computes_the_trained_model(
    trained, tmp_path):
  opts, summary, base = trained
  ckpt = os.path.join(summary["out"], "model")
  merged_dir, adapter_dir = str(tmp_path / "merged"), str(tmp_path / "adapter")
  assert main(["export", ckpt, merged_dir, "--merge-lora", "--quiet"]) == 0
  assert main(["export", ckpt, adapter_dir, "--adapter-only"]) == 0
  saved = saved_arrays(ckpt)
  scale = 8.0 / 4
  tensors = {k: v.to(torch.float64).numpy() if v.is_floating_point() else v.numpy()
             for k, v in load_file(os.path.join(merged_dir, "model.safetensors")).items()}
  pre = "language_model.model.layers."
  f64 = lambda a: np.asarray(a, np.float64)
  # a dense projection: the first MLA layer (3) q_a_proj, [out, in] = (W + s A B)^T in bf16
  a = saved[("mla", "q_a_proj", "lora", "lora_a")][0]
  b = saved[("mla", "q_a_proj", "lora", "lora_b")][0]
  want = f64(saved[("mla", "q_a_proj", "kernel")][0]) + scale * f64(a) @ f64(b)
  got = tensors[pre + "3.self_attn.q_a_proj.weight"]
  # float64 -> float32 -> bf16, as torch and XLA convert (convert/to_hf.py)
  np.testing.assert_array_equal(
      got, want.T.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))
  assert not np.array_equal(got, f64(saved[("mla", "q_a_proj", "kernel")][0]).T)
  # a routed expert (MoE layer 0 = decoder layer 1, expert 5): MXFP4 of dequant(W) + s A B
  codes = saved[("moe", "experts", "w1_packed")][0, 5]
  scales = saved[("moe", "experts", "w1_scale")][0, 5]
  w = mx.dequantize_np(codes, scales, np.float64).T
  a = saved[("moe", "experts", "w1_lora_a")][0, 5]
  b = saved[("moe", "experts", "w1_lora_b")][0, 5]
  q_codes, q_scales = mx.quantize_np((w + scale * f64(a) @ f64(b)).T)
  np.testing.assert_array_equal(tensors[pre + "1.block_sparse_moe.experts.5.w1.weight_packed"],
                                q_codes)
  np.testing.assert_array_equal(tensors[pre + "1.block_sparse_moe.experts.5.w1.weight_scale"],
                                q_scales)
  assert not np.array_equal(q_codes, codes)
  # the adapter file: every adapter array under its k3jax path, and its config
  adapters = load_file(os.path.join(adapter_dir, ADAPTER_FILE))
  assert set(adapters) == {".".join(p) for p in saved if is_adapter(p)}
  np.testing.assert_array_equal(adapters["moe.experts.w1_lora_a"].numpy(),
                                saved[("moe", "experts", "w1_lora_a")])
  with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
    config = json.load(f)
  assert (config["rank"], config["scale"], config["targets"]) == (4, 2.0, list(TARGETS))

  # the loaded export computes the trained model (float64): its experts are what the QAT
  # forward computed with (MXFP4 of W + s A B, re-quantised exactly); its MLA projections are
  # W + s A B in bf16, the official layout's dtype, so the reference folds the MLA adapters
  # and rounds them to bf16 likewise. Float64 summation order only: ~1e-12.
  with jax.enable_x64(True):
    ex64 = Execution(dtype="float64", param_dtype="float64")
    loaded, cfg64 = load_model(merged_dir, ex64)
    spec = lora.AdaptSpec(rank=4, alpha=8.0, targets=TARGETS, base_experts="mxfp4", qat=True)
    abstract = nnx.eval_shape(lambda: step_lib.make_model(cfg64, ex64, 0, spec))
    graphdef, abstract_state = nnx.split(abstract)
    flat = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(abstract_state)}
    trained_model = nnx.merge(graphdef, nnx.from_flat_state(
        {p: v.replace(jnp.asarray(saved[p]).astype(v.dtype)) for p, v in flat.items()}))
    ids = np.load(os.path.join(base, "reference.npz"))["input_ids"][:, :32]

    def reference(qat):
      for ex in lora.expert_paths(trained_model).values():
        ex.qat = qat
      ref = nnx.state(lora.merge(trained_model))

      def official_dtype(path, x):  # every other array holds the base's (or QB's) values,
        # which the export writes exactly (bf16 or F32 as the official layout has them)
        merged = tuple(str(getattr(k, "key", k)) for k in path)[0] == "mla"
        return x.astype(jnp.bfloat16).astype(x.dtype) if merged else x
      return nnx.merge(nnx.graphdef(loaded), jax.tree_util.tree_map_with_path(official_dtype, ref))

    got = logits(loaded, ids)
    want = logits(reference(True), ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-10)
    # without QAT the trained forward is not what the MXFP4 export computes
    unrounded = logits(reference(False), ids)
    assert float(jnp.max(jnp.abs(unrounded - got))) > 1e-6


@nnx.jit
def logits(model, ids):
  return model(ids).logits


def test_bad_lora_input_is_one_line_exit_2(tmp_path, reference_dir, capsys):
  base = os.path.join(reference_dir, "k3_tiny_a")
  common = ["train", "--out", str(tmp_path / "r"), "--init-from", base, "--no-progress",
            "--compile-cache", "none"]
  for extra, message in ((["--lora", "0"], "--lora RANK must be > 0, got 0"),
                         (["--lora", "4", "--lora-targets", "mla.*", "attn.*"],
                          "--lora-targets 'attn.*' matches no projection"),
                         (["--lora-alpha", "2"], "--lora-alpha and --lora-targets need --lora")):
    capsys.readouterr()
    assert main(common + extra) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_frozen_base_is_held_in_the_compute_dtype():
  """bf16 compute over fp32 masters (TPU/GPU): under LoRA the frozen base is held in bf16 (no
  master copy: half the bytes), the adapters and their AdamW moments in fp32, MXFP4 codes
  as uint8; a train step keeps every dtype (traced, not compiled)."""
  cfg, ex = MICRO, Execution(dtype="bfloat16", param_dtype="float32")
  spec = lora.AdaptSpec(rank=4, targets=TARGETS, base_experts="mxfp4")
  params, bias = jax.eval_shape(lambda: step_lib.init_params(cfg, ex, 0, spec))
  kinds = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = tuple(str(k.key) for k in path)
    kind = "adapter" if is_adapter(keys) else "packed" if x.dtype == jnp.uint8 else "base"
    kinds.setdefault(kind, set()).add(jnp.dtype(x.dtype).name)
  assert kinds == {"adapter": {"float32"}, "packed": {"uint8"}, "base": {"bfloat16"}}
  steps = step_lib.build(cfg, ex, step_lib.StepConfig(), spec=spec)
  state = jax.eval_shape(steps.init, params, bias, jax.ShapeDtypeStruct((2,), jnp.uint32))
  assert {jnp.dtype(x.dtype).name for x in jax.tree.leaves(state["opt_state"]) if x.ndim} == {
      "float32"}
  batch = {k: jax.ShapeDtypeStruct((1, 2, 16), dt) for k, dt in (
      ("inputs", jnp.int32), ("targets", jnp.int32), ("segment_ids", jnp.int32),
      ("loss_mask", jnp.bool_))}
  new_state, _ = jax.eval_shape(steps.train, state, batch, jax.ShapeDtypeStruct((), jnp.float32))
  assert jax.tree.map(lambda x: x.dtype, new_state["params"]) == jax.tree.map(
      lambda x: x.dtype, params)


def _float64_base_run(tmp_path, **extra) -> tuple[str, dict]:
  """(base, run options): a float64 MICRO model saved as a k3jax folder, and the options of a
  4-step LoRA run over it with a checkpoint every 2 steps."""
  ex = Execution(dtype="float64", param_dtype="float64")
  with jax.enable_x64(True):
    params, bias = step_lib.init_params(MICRO, ex, 0)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: step_lib.make_model(MICRO, ex, 0)))
    base = str(tmp_path / "base")
    ckpt_lib.save_model(base, graphdef, params, bias, MICRO)
  data = tmp_path / "sums.txt"
  data.write_text(conversations(100))
  return base, dict(init_from=base, data=str(data), dtype="float64", steps=4, decay_steps=4,
                    save_every=2, eval_every=4, warmup_steps=1, plots=False, tensorboard=False,
                    lora_rank=4, lora_alpha=8.0,
                    lora_targets=("mla.*", "moe.shared_experts.*"), **extra)


def test_float64_resume_over_a_k3jax_base_equals_the_straight_run(tmp_path, monkeypatch):
  """LoRA over a k3jax model folder (Orbax) in float64: stopped at its first checkpoint and
  resumed, the run computes the straight run's losses exactly, its checkpoints hold the
  adapters only and the fingerprint covers the Orbax files; a run whose first checkpoint holds
  the whole state (as LoRA checkpoints did before they left the base out) resumes the same."""
  base, common = _float64_base_run(tmp_path)
  straight = run(options(tmp_path / "straight", None, **common))
  want = [r["loss"] for r in read_records(straight["out"])]
  assert want[0] != want[-1]
  ckpt = os.path.join(straight["out"], "checkpoints", "4")
  assert all(p[0] != "params" or is_adapter(p[1:])
             for p in orbax_io.saved_paths(os.path.join(ckpt, "state")))
  checkpointer = ckpt_lib.Checkpointer(os.path.dirname(ckpt), keep=3)
  ref = checkpointer.base_reference(4)
  checkpointer.close()
  assert ref["folder"] == base and ref["fingerprint"] == fingerprint.fingerprint(base)
  assert "k3jax_config.json" in ref["fingerprint"] and ref["bytes"] == straight["base_bytes"]
  assert straight["checkpoint_bytes"] < straight["base_bytes"] / 2

  for name, whole_state in (("resumed", False), ("resumed_old", True)):
    out = tmp_path / name
    with monkeypatch.context() as m:
      if whole_state:  # checkpoints as before: no reference, the base inside
        m.setattr(frozen_base, "has_frozen", lambda mask: False)
      run(options(out, None, **{**common, "steps": 2}))
    checkpointer = ckpt_lib.Checkpointer(os.path.join(out, "checkpoints"), keep=3)
    assert (checkpointer.base_reference(2) is None) == whole_state
    checkpointer.close()
    resumed = run(options(out, None, **common))
    assert resumed["start_step"] == 2
    np.testing.assert_array_equal([r["loss"] for r in read_records(str(out))], want,
                                  err_msg=name)


@pytest.mark.long
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_resume_on_a_mesh_restores_adapters_into_their_shards(tmp_path):
  """The same stop-and-resume on a data x fsdp x tensor mesh: the adapters and their moments are
  restored into their shards, the base is loaded again and placed, and the losses equal the
  straight run's (float64)."""
  _, common = _float64_base_run(tmp_path, mesh="data=2,fsdp=2,tensor=2")
  straight = run(options(tmp_path / "straight", None, **common))
  out = tmp_path / "resumed"
  run(options(out, None, **{**common, "steps": 2}))
  resumed = run(options(out, None, **common))
  assert resumed["start_step"] == 2 and resumed["checkpoint_bytes"] < resumed["base_bytes"]
  np.testing.assert_array_equal([r["loss"] for r in read_records(str(out))],
                                [r["loss"] for r in read_records(straight["out"])])
