"""Teachers of on-policy distillation (`--teacher NAME=MODEL`, docs/rl.md#distillation).

A teacher scores the student's own trajectories: the log-probability, under its own
distribution (temperature 1), of every token the student sampled. MODEL is a model folder
(loaded on the run's mesh in the run's dtype and scored there, trajectories packed as the
train batch holds them) or the URL of a `k3jax serve` endpoint (each trajectory sent as token
ids to /v1/completions with echo, max_tokens 0 and logprobs: the prompt logprobs the server
computes from the full sequence). A teacher's vocabulary must be the student's (refused in one
line otherwise; a server reports its own in /v1/models). A server that does not answer is
asked again (`RETRIES` times, waiting 1, 2, 4 s); then the step raises TeacherUnavailable and
the run stops with one line after saving a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.error
import urllib.request

import jax
import numpy as np
from flax import nnx

from k3jax.errors import UserError
from k3jax.folders import model_folder
from k3jax.rl.step import LOGPROB_KEYS, token_logprobs
from k3jax.run.model import load_for_serving
from sharding import distributed

RETRIES = 3
TIMEOUT = 120.0  # seconds per request


class TeacherUnavailable(UserError):
  """A teacher server did not answer: the run stops (after a checkpoint)."""


def parse(text: str) -> tuple[str, str]:
  name, sep, source = text.partition("=")
  if not sep or not name or not source:
    raise UserError(f"--teacher {text!r}: expected NAME=MODEL_FOLDER or NAME=URL")
  return name, source


class ModelTeacher:
  """A model folder's weights on the run's mesh, scoring packed batches."""

  def __init__(self, name: str, path: str, dtype: str, mesh, vocab_size: int):
    if not os.path.isdir(path):
      raise UserError(f"--teacher {name}={path}: no such model folder")
    self.name, self.source, self.mesh = name, path, mesh
    model, cfg = load_for_serving(model_folder(path), dtype, mesh)
    if cfg.vocab_size != vocab_size:
      raise UserError(f"--teacher {name}={path}: its vocabulary has {cfg.vocab_size} ids, the "
                      f"student's {vocab_size}: distillation compares the same tokens")
    self.graphdef, self.state = nnx.split(model)

    def fn(state, batch):
      def one(mb):
        m = nnx.merge(self.graphdef, state)
        return token_logprobs(m, *(mb[k] for k in LOGPROB_KEYS), 1.0)[0]
      return jax.lax.map(one, {k: batch[k] for k in LOGPROB_KEYS})
    self._fn = jax.jit(fn)

  def logprobs(self, dev: dict, batch, trajectories) -> np.ndarray:
    """[rows, T] log pi_teacher(target) of the batch's positions."""
    del trajectories
    if self.mesh is None:
      out = self._fn(self.state, dev)
    else:
      with jax.set_mesh(self.mesh):
        out = self._fn(self.state, dev)
    return distributed.fetch(out).astype(np.float64).reshape(batch.rows, -1)


class ServerTeacher:
  """A `k3jax serve` endpoint: one echo request per trajectory (process 0 asks; the others
  take its answers)."""

  def __init__(self, name: str, url: str, vocab_size: int):
    self.name, self.source = name, url.rstrip("/")
    self.key = os.environ.get("K3JAX_TEACHER_API_KEY")
    if distributed.is_main_process():
      served = self._ask("GET", "/v1/models", None)["data"][0]
      if served.get("vocab_size") not in (None, vocab_size):
        raise UserError(f"--teacher {name}={url}: its vocabulary has {served['vocab_size']} "
                        f"ids, the student's {vocab_size}: distillation compares the same tokens")

  def _ask(self, method: str, path: str, body: dict | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if self.key:
      headers["Authorization"] = f"Bearer {self.key}"
    data = None if body is None else json.dumps(body).encode()
    error = None
    for attempt in range(RETRIES + 1):
      if attempt:
        time.sleep(2 ** (attempt - 1))
      req = urllib.request.Request(self.source + path, data=data, headers=headers,
                                   method=method)
      try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
          return json.loads(r.read())
      except urllib.error.HTTPError as e:  # an answer: asking again would not change it
        raise UserError(f"--teacher {self.name}={self.source}: HTTP {e.code}: "
                        f"{e.read()[:200].decode(errors='replace')}") from None
      except (urllib.error.URLError, OSError, TimeoutError) as e:
        error = e
    raise TeacherUnavailable(f"--teacher {self.name}={self.source} did not answer after "
                             f"{RETRIES + 1} tries: {getattr(error, 'reason', error)}")

  def sequence(self, ids: list[int]) -> list[float]:
    """log pi_teacher(ids[j] | ids[:j]) for j >= 1."""
    r = self._ask("POST", "/v1/completions", {"prompt": list(ids), "max_tokens": 0,
                                              "echo": True, "logprobs": 0, "temperature": 1.0})
    return [float(x) for x in r["choices"][0]["logprobs"]["token_logprobs"][1:]]

  def logprobs(self, dev: dict, batch, trajectories) -> np.ndarray:
    del dev
    out = np.zeros(batch.rollout_mask.shape, np.float64)
    if distributed.is_main_process():
      out = batch.per_token(trajectories, [self.sequence(t.ids) for t in trajectories],
                            np.float64)
    return distributed.from_main(out)


def load(specs, dtype: str, mesh, vocab_size: int) -> dict[str, object]:
  """name -> teacher of every --teacher."""
  teachers = {}
  for text in specs:
    name, source = parse(text)
    if name in teachers:
      raise UserError(f"--teacher {text!r}: the name {name} is taken")
    if source.startswith(("http://", "https://")):
      teachers[name] = ServerTeacher(name, source, vocab_size)
    else:
      teachers[name] = ModelTeacher(name, os.path.abspath(source), dtype, mesh, vocab_size)
  return teachers


@dataclasses.dataclass(frozen=True)
class Assignment:
  """Which teacher scores a data row: its `teacher` field, or the only one."""
  names: tuple[str, ...]

  def of(self, row: dict, where: str = "a data row") -> str:
    if len(self.names) == 1:
      return self.names[0]
    name = row.get("teacher")
    if name not in self.names:
      raise UserError(f"{where}: `teacher` must name one of {', '.join(self.names)} (several "
                      f"--teacher given), got {name!r}")
    return name
