"""`k3jax rl` with partial rollouts and with teachers, end to end through the CLI on the 2-layer
byte-level float64 model of test_run.py:

  * partial rollouts: a token budget leaves trajectories running into the next step (their
    tokens then older than the policy: staleness > 0), under keep and recompute, with TIS;
    --max-staleness 0 drops them;
  * on-policy distillation: a student learns a teacher's behaviour (the KL to it falls: the
    teacher is the student's own distribution at temperature 2); the
    same teacher served by `k3jax serve` (echo logprobs over HTTP) scores exactly as the model
    folder on the run's mesh (float64); a teacher with another vocabulary is refused, and one
    that stops answering ends the run in one line after a checkpoint.
"""

import json
import math
import os
import socket

import jax
import numpy as np
import pytest
from flax import nnx

from convert.load import load_any
from k3jax import cli
from k3jax.execution import NUMERICS
from k3jax.folders import model_folder
from k3jax.model.transformer import K3Model
from k3jax.rl import teacher as teacher_lib
from k3jax.rl.loop import METRICS
from tests.k3jax.model.helpers import randomize, tiny_cfg
from tests.k3jax.rl.test_run import flags, records
from tests.k3jax.server import helpers
from tests.k3jax.tokenizer import release


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("agentic")
  rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (2, 5),
                                                                      (4, 4))]
  (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (root / "score.py").write_text(
      "def score(prompt, completion, row):\n  return (sum(map(ord, completion)) % 10) / 10\n")
  model = helpers.byte_run(str(root / "model"))
  return {"model": model, "data": str(root / "data.jsonl"),
          "score": str(root / "score.py") + ":score", "root": root,
          "teacher": _flatter(model, str(root / "teacher"))}


def _flatter(student: str, folder: str) -> str:
  """A teacher: the student's weights with its head halved (its own distribution at
  temperature 2: the same behaviour, flatter)."""
  model, cfg = load_any(model_folder(student).weights, NUMERICS["float32"])
  model.lm_head.set_value(model.lm_head[...] * 0.5)
  return helpers._save(folder, model, cfg, "byte")


def _narrow(folder: str) -> str:
  """A model of vocabulary 64: not the byte-level student's."""
  cfg = tiny_cfg(num_layers=2, mla_layers=(1,))
  return helpers._save(folder, randomize(K3Model(cfg, rngs=nnx.Rngs(0))), cfg, "byte")


def finite(rs):
  for r in rs:
    assert all(math.isfinite(r[k]) for k in METRICS), r


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_partial_rollouts_carry_trajectories_across_updates(files, tmp_path, mode):
  out = tmp_path / mode
  args = flags(files, out, 4, "--no-plots", "--max-new-tokens", "12", "--rollout-budget",
               "20", "--partial-rollout", mode, "--is-correction", "tis", "--max-staleness",
               "3")
  assert cli.main(args) == 0
  rs = records(out)
  finite(rs)
  assert sum(r["carried"] for r in rs) > 0 and sum(r["trained_tokens"] for r in rs) > 0
  assert max(r["staleness_mean"] for r in rs) > 0   # tokens drawn by an older policy trained
  assert all(r["stale_dropped"] == 0 for r in rs)
  assert all(r["is_weight_mean"] > 0 for r in rs if r["trained_tokens"])


def test_stale_trajectories_are_dropped_and_counted(files, tmp_path):
  out = tmp_path / "stale"
  args = flags(files, out, 3, "--no-plots", "--max-new-tokens", "12", "--rollout-budget",
               "20", "--max-staleness", "0")
  assert cli.main(args) == 0
  rs = records(out)
  finite(rs)
  assert sum(r["stale_dropped"] for r in rs) > 0
  assert all(r["staleness_mean"] == 0 for r in rs)  # nothing older than its step trained


def distill_flags(files, out, steps, teacher, *extra):
  args = flags(files, out, steps, "--no-plots", "--teacher", f"t={teacher}", *extra)
  i = args.index("--reward")
  del args[i:i + 4]  # distillation alone: no reward terms
  return args


def test_a_student_learns_its_teachers_behaviour(files, tmp_path):
  out = tmp_path / "distill"
  assert cli.main(distill_flags(files, out, 10, files["teacher"], "--learning-rate",
                                "1e-4", "--distill-baseline")) == 0
  rs = records(out)
  finite(rs)
  kls = [r["distill_kl"] for r in rs]
  assert kls[0] > 0.1 and sum(kls[-3:]) / 3 < 0.7 * kls[0], kls


def test_a_served_teacher_scores_as_the_model_folder(files, tmp_path, monkeypatch):
  """Step 1 of the same run with the teacher as a folder on the mesh and as a `k3jax serve`
  URL: the same distill_kl, advantages and update (float64)."""
  folder = tmp_path / "folder"
  assert cli.main(distill_flags(files, folder, 1, files["teacher"])) == 0
  monkeypatch.setenv("K3JAX_TEACHER_API_KEY", helpers.KEY)
  with helpers.serving(files["teacher"], "--max-model-len", "64") as server:
    served = tmp_path / "served"
    assert cli.main(distill_flags(files, served, 1, server.url)) == 0
  (a,), (b,) = records(folder), records(served)
  for k in ("distill_kl", "loss", "grad_norm", "kl", "reward_mean"):
    assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k


def _named_teachers_run(files, tmp_path, name, teacher_of) -> int:
  """One step under two teachers, `t` (the flatter one) and `self` (the student's own copy),
  on the 4 prompts with the teacher each row names."""
  data = tmp_path / f"{name}.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "teacher": teacher_of(i)}) + "\n"
                          for i, (a, b) in enumerate(((1, 2), (3, 4), (2, 5), (4, 4)))))
  args = distill_flags(files, tmp_path / name, 1, files["teacher"], "--teacher",
                       f"self={files['model']}")
  args[args.index("--data") + 1] = str(data)
  return cli.main(args)


@pytest.mark.long
def test_rows_name_their_teacher(files, tmp_path):
  """Rows that all name the student's own copy distil nothing (float64: the engine's logprobs
  are the teacher's to 1e-9; the flatter teacher, given first, sees a KL > 0.1 on these
  samples, test_a_student_learns_its_teachers_behaviour)."""
  assert _named_teachers_run(files, tmp_path, "self", lambda i: "self") == 0
  (same,) = records(tmp_path / "self")
  assert abs(same["distill_kl"]) < 1e-9, same


def test_a_row_naming_no_given_teacher_refuses_the_run(files, tmp_path, capsys):
  assert _named_teachers_run(files, tmp_path, "unknown",
                             lambda i: "t" if i < 2 else "other") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "row 3: `teacher` must name one of t, self" in err[0], err


def test_teacher_refusals(files, tmp_path, capsys, monkeypatch):
  assert cli.main(distill_flags(files, tmp_path / "v", 1, _narrow(str(tmp_path / "v64")))) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "its vocabulary has 64 ids, the student's 256" in err[0], err

  # a served teacher that stops answering at step 2: one line, and step 1's checkpoint
  calls = []

  def sequence(self, ids):
    calls.append(1)
    if len(calls) > 8:  # step 1 scores its 8 trajectories
      raise teacher_lib.TeacherUnavailable(f"--teacher t={self.source} did not answer")
    return [0.0] * (len(ids) - 1)
  monkeypatch.setattr(teacher_lib.ServerTeacher, "sequence", sequence)
  monkeypatch.setattr(teacher_lib.ServerTeacher, "__init__", lambda self, name, url, vocab: (
      setattr(self, "name", name), setattr(self, "source", url)) and None)
  out = tmp_path / "gone"
  assert cli.main(distill_flags(files, out, 3, "http://127.0.0.1:9", "--save-every",
                                "10")) == 2
  err = capsys.readouterr().err.strip().splitlines()  # the run had started: its announcement
  assert len(err) == 2 and err[0].startswith("k3jax rl: ") and "error" not in err[0], err
  assert err[1].startswith("k3jax rl: error: ") and "did not answer" in err[1], err
  assert os.listdir(out / "checkpoints") == ["1"] and len(records(out)) == 1


def test_a_teacher_server_that_does_not_answer_is_asked_again_then_refused(monkeypatch):
  """Nothing listens on the port: the request is sent RETRIES more times, 1, 2 and 4 s apart,
  then TeacherUnavailable (a UserError: one line, exit 2) names the teacher."""
  with socket.socket() as s:  # a port that was free a moment ago: connections are refused
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  waits = []
  monkeypatch.setattr(teacher_lib.time, "sleep", waits.append)
  with pytest.raises(teacher_lib.TeacherUnavailable) as e:
    teacher_lib.ServerTeacher("t", f"http://127.0.0.1:{port}", 256)
  assert waits == [1, 2, 4] and teacher_lib.RETRIES == 3
  assert str(e.value).startswith(f"--teacher t=http://127.0.0.1:{port} did not answer after 4 "
                                 "tries") and "\n" not in str(e.value)


ENV = """
class Chat:
  def __init__(self, turns=3, long=0):
    self.turns, self.long, self.seen, self.row = turns, long, 0, None

  def reset(self, row):
    self.row = row
    return [{"role": "user", "content": row["q"]}]

  def step(self, action):
    self.seen += 1
    if self.row.get("fail") and self.seen == 1:
      raise RuntimeError("this environment failed")
    if self.seen >= self.turns:
      return [], 1.0, True, {"tool_calls": 1}
    text = "go on " + "x" * self.long
    return [{"role": "user", "content": text}], 0.25, False, {"tool_calls": 1}
"""


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
  """A float64-ready random model over the K2-shaped BPE vocabulary whose <|im_end|> is likely
  (turns end), saved as a run folder with that tokenizer; and the environment's file."""
  root = tmp_path_factory.mktemp("chat_rl")
  added = release.build(str(root / "tok"))
  cfg = tiny_cfg(vocab_size=max(added.values()) + 1, num_layers=2, mla_layers=(1,),
                 eos_token_id=added["<|im_end|>"])
  m = randomize(K3Model(cfg, rngs=nnx.Rngs(0)), seed=3)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 32))
  f = np.asarray(m(jax.numpy.asarray(ids)).features, np.float64).reshape(-1, cfg.hidden_size)
  mean = f.mean(0)
  head = np.array(m.lm_head[...])
  head[:, added["<|im_end|>"]] = 1.5 * mean / (mean @ mean)
  m.lm_head.set_value(jax.numpy.asarray(head, m.lm_head[...].dtype))
  (root / "chat_env.py").write_text(ENV)
  rows = [{"q": f"question {i}", "fail": i == 1} for i in range(4)]
  (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return helpers._save(str(root / "run"), m, cfg, str(root / "tok")), root


def env_flags(chat_model, out, *extra):
  folder, root = chat_model
  return ["rl", "--init-from", folder, "--data", str(root / "rows.jsonl"), "--env",
          f"{root / 'chat_env.py'}:Chat", "--group-size", "2", "--prompts-per-step", "4",
          "--max-new-tokens", "8", "--steps", "2", "--out", str(out), "--dtype", "float64",
          "--learning-rate", "1e-3", "--compile-cache", "none", "--no-tensorboard",
          "--no-progress", "--no-plots", *extra]


def test_an_environment_run_counts_turns_errors_and_overlong_trajectories(chat_model, tmp_path):
  out = tmp_path / "env"
  assert cli.main(env_flags(chat_model, out)) == 0
  rs = records(out)
  finite(rs)
  assert all(r["env_errors"] == 2 for r in rs)  # row 1's two samples, each step
  assert max(r["turns"] for r in rs) > 1 and sum(r["tool_calls"] for r in rs) > 0
  assert all(r["mismatch_max"] <= 1e-9 for r in rs if r["trained_tokens"])
  with open(out / "env_errors.jsonl") as f:
    errors = [json.loads(line) for line in f]
  assert len(errors) == 4 and all("this environment failed" in e["error"] for e in errors)
  assert {e["row"] for e in errors} == {1}

  short = tmp_path / "short"
  assert cli.main(env_flags(chat_model, short, "--env-arg", "long=200",
                            "--max-trajectory-tokens", "120")) == 0
  assert sum(r["overlong"] for r in records(short)) > 0


def test_a_bad_environment_refuses_the_run(chat_model, tmp_path, capsys):
  _, root = chat_model
  args = env_flags(chat_model, tmp_path / "bad")
  args[args.index("--env") + 1] = f"{root / 'chat_env.py'}:Missing"
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "has no class 'Missing'" in err[0], err
  assert not (tmp_path / "bad" / "metrics.jsonl").exists()
