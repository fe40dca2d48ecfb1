"""`k3jax serve`: an OpenAI-compatible HTTP server on the serving engine (docs/serving.md).

  k3jax serve runs/tiny                          http://127.0.0.1:8000/v1, model "tiny"
  k3jax serve K3_DIR --mesh tensor=8 --api-key KEY --max-num-seqs 64 --served-model-name k3

MODEL: an official folder, a converted checkpoint or a `k3jax train` output. Endpoints:
/v1/models, /v1/completions, /v1/chat/completions (the folder's chat template; reasoning and
tool calls parsed back), /health (503 while the weights load), /metrics (Prometheus), and
/tokenize, /detokenize, /tokenizer_info. Requests are served together by the engine, up to
--max-num-seqs at once. Loopback only unless --host says otherwise; with --api-key (or the
K3JAX_API_KEY environment variable) every request but /health and /metrics needs
`Authorization: Bearer KEY`. Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import os
import sys

from k3jax.commands._args import (
  Formatter,
  add_draft_flags,
  add_engine_flags,
  add_tokenizer_flag,
  engine_options,
  nonneg_int,
)
from k3jax.server import build

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def run(args: argparse.Namespace) -> int:
  options = engine_options(args, host=args.host, port=args.port,
                           api_key=args.api_key or os.environ.get("K3JAX_API_KEY") or None,
                           served_model_name=args.served_model_name, log_level=args.log_level)
  server = build(options)
  print(f"k3jax serve: {args.model} as {server.service.config.name!r} on {server.url}/v1 "
        "(loading the weights; /health answers 503 until ready)", file=sys.stderr, flush=True)
  server.run()
  return 0


def register(sub) -> None:
  p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                     description=__doc__, formatter_class=Formatter)
  p.add_argument("model", metavar="MODEL",
                 help="official folder, converted checkpoint, or `k3jax train` output folder")
  p.add_argument("--host", default="127.0.0.1",
                 help="the address to listen on (0.0.0.0: every interface)")
  p.add_argument("--port", type=nonneg_int, default=8000, help="0: any free port")
  p.add_argument("--api-key", metavar="KEY", default=None,
                 help="the Bearer token requests must carry (default: $K3JAX_API_KEY; unset: "
                      "none)")
  p.add_argument("--served-model-name", metavar="NAME", default=None,
                 help="the model name requests use (default: the folder's name)")
  add_tokenizer_flag(p)
  add_engine_flags(p, max_num_seqs=16)
  add_draft_flags(p)
  p.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                 help="uvicorn's logging (info: one line per request)")
  p.set_defaults(func=run)
