"""A server for a model folder: what `k3jax serve` and `k3jax eval` start.

    server = launch.build(ServeOptions(model="runs/tiny", port=8000))
    server.run()                   # blocks (Ctrl-C stops it), or:
    server.start(); ...; server.stop()   # in a thread (eval, tests): server.url

`build` reads what is cheap and can be wrong at once (the folder, its config and tokenizer,
the flags) and binds the port; the weights load in the engine thread while the server already
answers (/health 503 until the engine is ready).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time

import uvicorn
from flax import nnx

import configs
from k3jax.engine import DEFAULT_MAX_MODEL_LEN, Engine, EngineConfig, check_shards
from k3jax.errors import UserError
from k3jax.execution import resolve_dtype
from k3jax.folders import max_model_len, model_folder
from k3jax.model.context_parallel import size as context_size
from k3jax.run.model import Experts, existing_folder, load_for_serving
from k3jax.server.app import build_app
from k3jax.server.draft import check_draft, make_drafter
from k3jax.server.loop import EngineLoop, State
from k3jax.server.service import Service, ServiceConfig
from k3jax.server.structured import Grammars
from k3jax.tokenizer import load_tokenizer, text_tokenizer
from sharding.mesh import make_mesh

END_OF_TURN = ("<|im_end|>",)  # a chat answer ends here (Kimi's chat format)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeOptions:
  """`k3jax serve`'s flags (docs/serving.md)."""
  model: str
  tokenizer: str | None = None
  mesh: str | None = None
  host: str = "127.0.0.1"
  port: int = 8000
  api_key: str | None = None
  served_model_name: str | None = None
  dtype: str = "auto"
  experts: Experts | None = None  # None: as the folder stores them
  max_num_seqs: int = 16
  max_model_len: int | None = None
  prefill_chunk: int = 512
  prefill_widths: int = 1
  prefill_rows: int = 1
  decode_steps: int = 1
  prefix_state_every: int = 4
  data_shards: int = 1
  draft: str | None = None  # "ngram" or a model folder (k3jax/server/draft.py)
  num_draft_tokens: int = 4
  log_level: str = "warning"


def build(options: ServeOptions) -> Server:
  folder = existing_folder(options.model)
  dtype = resolve_dtype(options.dtype)
  cfg = configs.resolve(folder.weights)
  if options.tokenizer:
    tokenizer = load_tokenizer(options.tokenizer, folder.tokenizer.folder)
  else:
    tokenizer = text_tokenizer(folder.tokenizer, cfg.vocab_size)
  if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
    raise UserError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the model's "
                    f"vocabulary of {cfg.vocab_size}")
  limit = options.max_model_len or max_model_len(folder) or DEFAULT_MAX_MODEL_LEN
  mesh = make_mesh(options.mesh) if options.mesh else None
  try:  # a mesh's context axis spreads a request's latent pages by position
    engine_config = EngineConfig(max_num_seqs=options.max_num_seqs, max_model_len=limit,
                                 prefill_chunk=options.prefill_chunk,
                                 prefill_widths=options.prefill_widths,
                                 prefill_rows=options.prefill_rows,
                                 decode_steps=options.decode_steps,
                                 prefix_state_every=options.prefix_state_every,
                                 data_shards=options.data_shards,
                                 context_shards=context_size(mesh))
  except ValueError as e:
    raise UserError(str(e)) from None
  if options.draft:  # its flags named in the error, then the engine's field
    check_draft(options.draft, options.num_draft_tokens, cfg, tokenizer,
                engine_config.page_size, options.data_shards, engine_config.context_shards)
    engine_config = dataclasses.replace(engine_config, num_draft_tokens=options.num_draft_tokens)
  if mesh is not None:
    try:
      check_shards(engine_config.data_shards, mesh, engine_config.context_shards)
    except ValueError as e:
      raise UserError(f"--data-shards: {e}") from None

  def load() -> Engine:
    t0 = time.perf_counter()
    model, _ = load_for_serving(folder, dtype, mesh, options.experts)
    drafter = make_drafter(options.draft, options.num_draft_tokens, engine_config, dtype, mesh,
                           options.experts)
    engine = Engine(model, engine_config, mesh=mesh, drafter=drafter)
    print(f"k3jax serve: {cfg.num_layers} layers, {dtype}, loaded in "
          f"{time.perf_counter() - t0:.1f}s: ready", file=sys.stderr, flush=True)
    if grammars is not None:  # the grammar library reads the vocabulary once, meanwhile
      threading.Thread(target=grammars.prepare, name="k3jax-grammar", daemon=True).start()
    return engine

  def reload(path: str):
    """The state of checkpoint `path` for the served model (POST /update_weights): loaded as
    the served weights were, on the same mesh; UserError when it is not that model."""
    if not os.path.exists(path):
      raise UserError(f"{path}: no such model folder")
    new = model_folder(path)
    other = configs.resolve(new.weights)
    if other != cfg:
      diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(
          other, f.name)]
      raise UserError(f"{path}: not the served model's config (differs in "
                      f"{', '.join(diff[:5])})")
    model, _ = load_for_serving(new, dtype, mesh, options.experts)
    return nnx.state(model)

  eos = () if cfg.eos_token_id is None else (int(cfg.eos_token_id),)
  specials = getattr(tokenizer, "special_tokens", {})
  chat_stops = tuple(getattr(tokenizer, "stop_ids", ())) + tuple(
      specials[t] for t in END_OF_TURN if t in specials)
  name = options.served_model_name or os.path.basename(os.path.normpath(options.model))
  chat_stops = tuple(dict.fromkeys(chat_stops))
  grammars = (Grammars(tokenizer, cfg.vocab_size, tuple(dict.fromkeys(eos + chat_stops)))
              if tokenizer is not None and eos + chat_stops else None)
  service = Service(ServiceConfig(name=name, max_model_len=limit, eos_token_ids=eos,
                                  chat_stop_ids=chat_stops, api_key=options.api_key,
                                  vocab_size=cfg.vocab_size),
                    EngineLoop(load, x64=dtype == "float64", reload=reload), tokenizer, grammars)
  return Server(service, options.host, options.port, options.log_level)


class Server:
  """uvicorn serving the app on a socket bound at construction (port 0: any free one)."""

  def __init__(self, service: Service, host: str, port: int, log_level: str = "warning"):
    self.service = service
    self.socket = _bind(host, port)
    self.port = self.socket.getsockname()[1]
    self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
    self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(service), log_level=log_level,
                                                 access_log=False, lifespan="on",
                                                 timeout_graceful_shutdown=5))
    self._thread: threading.Thread | None = None
    service.loop.on_state = self._on_state

  def _on_state(self, state: State) -> None:
    if state == State.FAILED and self._thread is None:
      self.uvicorn.should_exit = True  # `k3jax serve` reports the error and exits

  def run(self) -> None:
    """Serve until interrupted; UserError if the model failed to load or the engine died
    (`k3jax serve` then exits non-zero, for a supervisor to restart it)."""
    self.uvicorn.run(sockets=[self.socket])
    loop = self.service.loop
    if loop.state == State.FAILED:
      raise UserError(loop.failure)

  def start(self, timeout: float = 60.0) -> Server:
    """Serve from a thread; returns once the server accepts connections."""
    self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                    name="k3jax-http", daemon=True)
    self._thread.start()
    deadline = time.monotonic() + timeout
    while not self.uvicorn.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError("the HTTP server did not start")
      time.sleep(0.01)
    return self

  def wait_ready(self, timeout: float | None = None) -> None:
    """Block until the engine is ready; UserError if the model failed to load."""
    loop = self.service.loop
    if not loop.ready.wait(timeout):
      raise TimeoutError("the model did not finish loading in time")
    if loop.state == State.FAILED:
      raise UserError(loop.failure)

  def stop(self) -> None:
    self.uvicorn.should_exit = True
    if self._thread is not None:
      self._thread.join(30)
    self.socket.close()


def _bind(host: str, port: int) -> socket.socket:
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
  return sock
