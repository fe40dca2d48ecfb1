"""`k3jax rl` end to end through the CLI, on a 2-layer byte-level float64 model
(tests/k3jax/server/helpers.py): the metrics file, the engine's rollout logprobs against the
trainer's, a completion that is only its stop token, exact resume, rewards that fail, LoRA
(checkpoints of the adapters only, resumed exactly over the base they refer to), bad flags,
a mesh, and (long) two processes on one mesh.

Every run has the same shapes (4 prompts of 4 bytes x 2 samples of 4 tokens), so the engine
step, the reference logprobs and the train step compile once for the file (LoRA: its own step).
"""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from convert import orbax_io
from convert.fingerprint import fingerprint, weight_bytes
from convert.lora_export import is_adapter
from k3jax import cli
from k3jax.errors import UserError
from k3jax.folders import model_folder
from k3jax.rl import batch as batch_lib
from k3jax.rl import learner as learner_lib
from k3jax.rl import loop
from k3jax.rl import rollout as rollout_lib
from k3jax.rl.loop import METRICS
from k3jax.tokenizer import ByteTokenizer
from k3jax.train.checkpoint import Checkpointer
from tests.k3jax.server.helpers import byte_run, packable_run
from tests.sharding.test_multiprocess import free_port, process_env

TIMING = ("rollout_s", "reward_s", "reference_s", "train_s", "step_time_s", "tokens_per_s")
MISMATCH = 1e-9  # float64: only the order of the engine's and the trainer's sums differs

# a reward that differs between most completions, so every group trains
SCORE = """
def score(prompt, completion, row):
  return (sum(map(ord, completion)) % 10) / 10
"""
# a raise, a NaN and (once: the marker file) a hang past the timeout
BAD = """
import os
import time

def score(prompt, completion, row):
  if row["mode"] == "raise":
    raise ValueError("bad sample")
  if row["mode"] == "nan":
    return float("nan")
  if row["mode"] == "hang" and not os.path.exists(row["marker"]):
    open(row["marker"], "w").close()
    time.sleep(600)
  return 1.0
"""


# SCORE's reward, and a line (prompt, completion) per call in LOG_PATH
LOGGED = """
import json

def score(prompt, completion, row):
  with open(LOG_PATH, "a") as f:
    f.write(json.dumps([prompt, completion]) + "\\n")
  return (sum(map(ord, completion)) % 10) / 10
"""


def _write(path, text: str) -> str:
  path.write_text(text)
  return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("rl")
  rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (2, 5),
                                                                      (4, 4))]
  return {"model": byte_run(str(root / "model")),
          "data": _write(root / "data.jsonl", "".join(json.dumps(r) + "\n" for r in rows)),
          "score": _write(root / "score.py", SCORE) + ":score",
          "bad": _write(root / "bad.py", BAD) + ":score", "root": root}


def flags(files, out, steps, *extra):
  return ["rl", "--init-from", files["model"], "--data", files["data"], "--reward", "numeric",
          "--reward", files["score"], "--group-size", "2", "--prompts-per-step", "4",
          "--max-new-tokens", "4", "--steps", str(steps), "--out", str(out), "--dtype",
          "float64", "--learning-rate", "1e-2", "--compile-cache", "none", "--no-tensorboard",
          "--no-progress", *extra]


def records(out) -> list[dict]:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def weights(out) -> dict[tuple[str, ...], np.ndarray]:
  """Every array of the run's final model as saved (adapters too, under LoRA)."""
  model = os.path.join(out, "model")
  return {p: np.asarray(orbax_io.open_array(model, p).read().result())
          for p in orbax_io.saved_paths(model)}


def same_weights(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[p], b[p]) for p in a)


@pytest.fixture(scope="module")
def straight(files):
  """4 steps in one run, a checkpoint every 2."""
  out = files["root"] / "straight"
  assert cli.main(flags(files, out, 4, "--save-every", "2", "--no-plots")) == 0
  return out


def test_metrics_one_finite_line_per_step_and_rollout_logprobs_are_the_trainers(files, capsys):
  out = files["root"] / "metrics"
  assert cli.main(flags(files, out, 3, "--json")) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["last"]["step"] == 3 and os.path.isfile(summary["plots"][0])
  rs = records(out)
  assert [r["step"] for r in rs] == [1, 2, 3]
  for r in rs:
    assert all(math.isfinite(r[k]) for k in METRICS), r
    assert r["mismatch_max"] <= MISMATCH and r["reward_errors"] == 0
    assert r["trained_tokens"] > 0 and r["updates"] == 1
  assert rs[-1]["kl"] > 0  # the policy moved away from the reference
  assert summary["last"] == rs[-1]
  assert os.path.isdir(out / "model")


def test_resume_mid_run_equals_the_straight_run(files, straight, capsys):
  out = files["root"] / "resumed"
  assert cli.main(flags(files, out, 2, "--no-plots")) == 0
  capsys.readouterr()
  assert cli.main(flags(files, out, 4, "--no-plots", "--json")) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["start_step"] == 2

  def strip(rs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]

  assert strip(records(out)) == strip(records(straight))
  assert same_weights(weights(out), weights(straight))


def test_failing_rewards_and_long_prompts_are_counted_and_the_run_goes_on(files, tmp_path):
  marker = str(tmp_path / "hung-once")
  rows = [{"prompt": f"{i}+{i}=", "mode": mode, "marker": marker}
          for i, mode in enumerate(("raise", "nan", "hang"))]
  rows.append({"prompt": "9+9=" * 10, "mode": "ok", "marker": marker})  # past the context
  data = _write(tmp_path / "bad.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "out"
  args = flags(files, out, 1, "--no-plots", "--reward-timeout", "2", "--max-model-len", "16")
  args[args.index(files["data"])] = data
  args[args.index("numeric") - 1:args.index(files["score"]) + 1] = ["--reward", files["bad"]]
  assert cli.main(args) == 0
  (r,) = records(out)
  assert all(math.isfinite(r[k]) for k in METRICS), r
  # raise and nan: both samples each; hang: the first sample only (the second finds the marker)
  assert r["reward_errors"] == 5 and r["prompts_too_long"] == 1
  assert r["groups_uniform"] == 2 and r["trained_tokens"] > 0
  with open(out / "reward_errors.jsonl") as f:
    errors = [json.loads(line)["error"] for line in f]
  assert len(errors) == 5
  assert sum("ValueError: bad sample" in e for e in errors) == 2
  assert sum("not a finite number" in e for e in errors) == 2
  assert sum("TimeoutError" in e for e in errors) == 1


def test_lora_runs_its_reference_is_the_base_and_checkpoints_hold_the_adapters(
    files, tmp_path, capsys):
  """LoRA RL over a copy of the model: the reference is the base; a checkpoint holds only
  adapter arrays and a reference to the base folder; resumed from its first checkpoint the
  run rebuilds the base and equals the straight run; a changed or missing base is refused
  in one line."""
  base = str(tmp_path / "base")
  shutil.copytree(files["model"], base)
  args = flags(files, tmp_path / "lora", 2, "--no-plots", "--lora", "4", "--save-every", "1",
               "--json")
  args[args.index(files["model"])] = base
  assert cli.main(args) == 0
  summary = json.loads(capsys.readouterr().out.splitlines()[-1])
  out = summary["out"]
  first, second = records(out)
  assert all(math.isfinite(r[k]) for r in (first, second) for k in METRICS)
  assert first["kl"] <= 1e-12 < second["kl"]  # adapters start at zero: the base itself
  assert first["mismatch_max"] <= MISMATCH and second["mismatch_max"] <= MISMATCH

  weights_dir = model_folder(base).weights
  ckpt = os.path.join(out, "checkpoints", "2")
  params = [p[1:] for p in orbax_io.saved_paths(os.path.join(ckpt, "state")) if p[0] == "params"]
  assert params and all(is_adapter(p) for p in params), params
  checkpointer = Checkpointer(os.path.dirname(ckpt), keep=2)
  ref = checkpointer.base_reference(2)
  checkpointer.close()
  assert ref["folder"] == weights_dir and ref["fingerprint"] == fingerprint(weights_dir)
  assert summary["base_bytes"] == ref["bytes"] == weight_bytes(weights_dir)
  assert summary["checkpoint_bytes"] == sum(
      os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)

  resumed = tmp_path / "resumed"  # stopped after step 1's checkpoint
  shutil.copytree(out, resumed)
  shutil.rmtree(resumed / "checkpoints" / "2")
  args[args.index(out)] = str(resumed)
  assert cli.main(args) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["start_step"] == 1

  def strip(rs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]

  assert strip(records(resumed)) == strip(records(out))
  assert same_weights(weights(resumed), weights(out))

  args[args.index("--steps") + 1] = "3"
  largest = max((os.path.join(d, f) for d, _, fs in os.walk(weights_dir) for f in fs),
                key=os.path.getsize)
  with open(largest, "ab") as f:  # one byte more
    f.write(b"\0")

  def refused(message):
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err

  refused(f"{weights_dir}: not the base checkpoint 2 of {resumed}")
  os.rename(base, base + "_moved")
  refused(f"{base}: the base of the run in {resumed} is missing")
  assert sorted(os.listdir(resumed / "checkpoints")) == ["1", "2"]  # the refusals left it
  assert strip(records(resumed)) == strip(records(out))


def test_experts_qat_rollouts_are_the_trained_policy(files, tmp_path):
  """--experts-qat over an MXFP4 base with per-expert adapters: the trainer's forward rounds
  dequant(W) + scale A B to MXFP4, and the engine samples from exactly that (packed once per
  set_params), so the float64 rollout logprobs are the trainer's at every step, the adapters
  having moved the experts after the first."""
  folder = packable_run(str(tmp_path / "model"))
  args = flags(files, tmp_path / "qat", 2, "--no-plots", "--experts-qat", "--lora", "4",
               "--base-experts", "mxfp4", "--lora-targets", "moe.experts.*", "mla.*")
  args[args.index(files["model"])] = folder
  assert cli.main(args) == 0
  first, second = records(tmp_path / "qat")
  assert first["mismatch_max"] <= MISMATCH and second["mismatch_max"] <= MISMATCH
  assert second["kl"] > 0 and second["trained_tokens"] > 0


def test_a_capacity_factor_is_refused(files, tmp_path):
  """RL scores every rollout dropless: run(RLOptions) refuses a capacity factor in one line."""
  opts = loop.RLOptions(init_from=files["model"], data=files["data"], reward=("numeric",),
                        group_size=2, steps=1, out=str(tmp_path / "out"), capacity_factor=1.25)
  with pytest.raises(UserError, match="capacity factor 1.25: RL scores every rollout dropless"):
    loop.run(opts)
  assert not os.path.exists(tmp_path / "out")


def _spy_rollouts(monkeypatch) -> list:
  """Each step's complete groups of trajectories, as Rollouts returns them."""
  seen = []
  original = rollout_lib.Rollouts.__call__

  def call(self, step, version):
    out = original(self, step, version)
    seen.append(out.complete)
    return out
  monkeypatch.setattr(rollout_lib.Rollouts, "__call__", call)
  return seen


def _spy_reference(monkeypatch) -> list:
  """The reference policy's logprobs of each step's batch, and the batch's layout."""
  seen = []
  original = learner_lib.Learner.learn

  def learn(self, state, groups, rewards, version):
    reference = self.reference

    def recorded(*a):
      out = reference(*a)
      seen.append(np.asarray(out))
      return out  # the device array: the train step takes it as the run would
    self.reference = recorded
    try:
      return original(self, state, groups, rewards, version)
    finally:
      self.reference = reference
  monkeypatch.setattr(learner_lib.Learner, "learn", learn)
  return seen


def test_a_completion_that_is_only_its_stop_token(files, tmp_path, monkeypatch):
  """A completion whose first draw is the stop token: one token, the stop, and empty text.
  The stop id is the token the policy draws first for one (prompt, sample) of step 1, read
  from a run without stop ids (the draw depends only on the weights, the prompt and the
  draw's seed, so a second run with that stop id draws it again and stops)."""
  args = flags(files, tmp_path / "probe", 1, "--no-plots")
  probe = _spy_rollouts(monkeypatch)
  assert cli.main(args) == 0
  (groups,) = probe
  first = groups[0].members[0]
  stop = first.ids[len(first.prompt.ids)]

  log = tmp_path / "rewards.jsonl"
  reward = _write(tmp_path / "logged.py", LOGGED.replace("LOG_PATH", repr(str(log))))
  args = flags(files, tmp_path / "out", 1, "--no-plots")
  args[args.index(files["score"])] = reward + ":score"
  monkeypatch.setattr(ByteTokenizer, "stop_ids", (stop,))  # as a tokenizer's end of turn
  seen, ref = _spy_rollouts(monkeypatch), _spy_reference(monkeypatch)
  assert cli.main(args) == 0
  (groups,), (ref_logp,) = seen, ref
  c = groups[0].members[0]
  n = len(c.prompt.ids)
  assert c.prompt == first.prompt and c.ids[n:] == [stop] and c.finish == "stop"
  assert not c.truncated and c.text == ""
  assert c.logprobs[n] == pytest.approx(first.logprobs[n], abs=1e-12)
  # the trainer's logprob of that token: the reference policy's at step 1 is the policy's
  # (at the position whose target is the completion's first token, wherever it was packed)
  trajs = [t for g in groups for t in g.members]
  lengths = [len(t.ids) for t in trajs]
  row, at = batch_where(lengths, ref_logp.shape[-1])[0]
  trainer = ref_logp.reshape(-1, ref_logp.shape[-1])[row, at + n - 1]
  assert abs(trainer - c.logprobs[n]) <= MISMATCH
  with open(log) as f:
    scored = [tuple(json.loads(line)) for line in f]
  assert (c.prompt.text, "") in scored  # the reward saw the empty text

  (r,) = records(tmp_path / "out")
  assert all(math.isfinite(r[k]) for k in METRICS), r
  assert r["completion_len"] == pytest.approx(np.mean([t.generated for t in trajs]),
                                              rel=1e-12)  # the stop token counts: 1 here
  assert r["empty_completions"] == sum(not t.text.strip() for t in trajs) >= 1
  assert r["truncated"] == pytest.approx(np.mean([t.truncated for t in trajs]))
  assert r["mismatch_max"] <= MISMATCH and r["updates"] == 1 and r["trained_tokens"] > 0


def batch_where(lengths, seq_len):
  """(row, first position) of each trajectory as batch.pack lays them out."""
  where = [None] * len(lengths)
  for row, members in enumerate(batch_lib.pack(lengths, seq_len)):
    at = 0
    for i in members:
      where[i] = (row, at)
      at += lengths[i] - 1
  return where


@pytest.mark.parametrize("extra, message", [
    (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1"),
    (["--updates-per-step", "0"], "--updates-per-step must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--reward-timeout", "0"], "--reward-timeout must be > 0"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--grad-accum", "3"], "not a multiple of --grad-accum 3"),
    (["--reward", "no-such-reward"], "expected a built-in"),
    (["--reward", "/nowhere/r.py:f"], "no such file"),
    (["--algorithm", "grpo", "--clip-eps", "1.5"], "clip ranges"),
    (["--coordinator", "localhost:1"], "--num-processes and --process-id go together"),
])
def test_bad_flags_exit_2_with_one_line(files, tmp_path, capsys, extra, message):
  args = flags(files, tmp_path / "out", 1, "--no-plots")
  for i in range(0, len(extra), 2):  # replace a flag's value, or append the flag
    if extra[i] in args and extra[i] != "--reward":
      args[args.index(extra[i]) + 1] = extra[i + 1]
    else:
      args += extra[i:i + 2]
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("k3jax rl: error: ") and message in err[0], err


def test_bad_paths_exit_2_with_one_line(files, tmp_path, capsys):
  for bad, message in ((["--init-from", str(tmp_path / "nowhere")], "no such folder"),
                       (["--data", str(tmp_path / "none.jsonl")], "--data")):
    args = flags(files, tmp_path / "out", 1, "--no-plots")
    args[args.index(bad[0]) + 1] = bad[1]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def same_metrics(rs: list[dict], expected: list[dict]) -> None:
  """Equal to float64 summation order, step by step (timing aside)."""
  assert [r["step"] for r in rs] == [r["step"] for r in expected]
  for r, e in zip(rs, expected):
    for k in METRICS:
      if k not in TIMING:
        assert r[k] == pytest.approx(e[k], rel=1e-9, abs=1e-12), (r["step"], k)


MESH = "data=2,fsdp=2,tensor=2"


@pytest.fixture(scope="module")
def mesh_run(files):
  """2 steps with the policy, the optimizer and the engine on a data x fsdp x tensor mesh of
  the 8 test devices, in this process."""
  out = files["root"] / "mesh"
  assert cli.main(flags(files, out, 2, "--no-plots", "--mesh", MESH)) == 0
  return out


def test_a_mesh_run_equals_one_device(straight, mesh_run):
  """The same rollouts, rewards and updates as one device (float64: to summation order)."""
  same_metrics(records(mesh_run), records(straight)[:2])


# step 1, then resumed from its checkpoint for step 2, in one interpreter (one compile)
DRIVER = """
import sys
from k3jax.cli import main
args = sys.argv[1:]
assert main(args) == 0
args[args.index("--steps") + 1] = "2"
sys.exit(main(args))
"""


@pytest.mark.long
def test_two_processes_equal_one_process(files, mesh_run, tmp_path):
  """`k3jax rl` in 2 processes x 4 CPU devices (jax.distributed on localhost, gloo) on the same
  mesh as `mesh_run`'s 8 devices in one process: both draw the same prompts and completions,
  process 0 scores them, and the metrics equal the one-process run's, step 2 resumed from the
  step-1 checkpoint (each process's shards; the data position that process 0 wrote)."""
  out = tmp_path / "two"
  args = flags(files, out, 1, "--no-plots", "--mesh", MESH, "--save-every", "1",
               "--coordinator", f"localhost:{free_port()}", "--num-processes", "2")
  procs = [subprocess.Popen([sys.executable, "-c", DRIVER, *args, "--process-id", str(i)],
                            env=process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    ends = [p.communicate(timeout=900) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, (_, err)) in enumerate(zip(procs, ends)):
    assert p.returncode == 0, f"process {i}: {err[-3000:]}"
  assert "2 process(es)" in ends[0][1] and "process(es)" not in ends[1][1]  # process 0 reports
  same_metrics(records(out), records(mesh_run))
  assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"] and os.path.isdir(out / "model")
  assert "resuming at step 1" in ends[0][1]
