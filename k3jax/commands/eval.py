"""`k3jax eval`: lm-evaluation-harness against a model, through a server this command starts
(docs/serving.md#evaluation). Needs the `eval` extra: pip install -e '.[eval]' -c constraints.txt.

  k3jax eval runs/tiny --tasks tests/k3jax/server/tasks/tiny_mc.yaml --out evals/tiny
  k3jax eval K3_DIR --mesh tensor=8 --tasks mmlu,gsm8k --limit 200 --out evals/k3

The model is served on a free loopback port (as `k3jax serve` serves it) and the harness calls
it as an OpenAI-compatible completions API (`local-completions`), with the server's own
tokenizer (/tokenize): log-likelihoods from the prompt logprobs of `echo` requests, generations
greedy by default. --tasks takes the harness's task names (its own tasks read their data from
the Hugging Face hub, as the harness does) and task YAML files of your own, whose relative
`dataset_kwargs.data_files` are read next to the file (no download: `dataset_path: json`).
Writes the harness's results to OUT/results.json (and with --log-samples each task's
samples to OUT/samples_TASK.jsonl) and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from k3jax.commands._args import (
  Formatter,
  add_draft_flags,
  add_engine_flags,
  add_tokenizer_flag,
  engine_options,
  positive_int,
)
from k3jax.errors import UserError
from k3jax.server import build


def _relative_data_files(value, base: str):
  """data_files with relative paths made absolute against `base` (None if none was)."""
  if isinstance(value, str):
    return None if os.path.isabs(value) else os.path.join(base, value)
  if isinstance(value, list):
    fixed = [_relative_data_files(v, base) for v in value]
    return None if all(f is None for f in fixed) else [
        f if f is not None else v for f, v in zip(fixed, value)]
  if isinstance(value, dict):
    fixed = {k: _relative_data_files(v, base) for k, v in value.items()}
    return None if all(f is None for f in fixed.values()) else {
        k: f if f is not None else value[k] for k, f in fixed.items()}
  return None


def resolve_tasks(items: list[str], work: str) -> tuple[list[str], list[str], bool]:
  """(task names, include paths, whether the harness's own tasks are needed). A task file is
  included through a wrapper in `work` that reads its relative data files next to it."""
  import yaml  # noqa: PLC0415 - comes with the harness (the eval extra), not a core dependency

  class Loader(yaml.SafeLoader):  # reads the plain keys; tags (!function) are the harness's
    pass
  Loader.add_multi_constructor("!", lambda loader, suffix, node: None)

  names, include, builtin = [], [], False
  for item in items:
    if not os.path.isfile(item):
      names.append(item)
      builtin = True
      continue
    path = os.path.abspath(item)
    try:
      with open(path) as f:
        config = yaml.load(f, Loader=Loader)  # a SafeLoader subclass
    except (OSError, yaml.YAMLError) as e:
      raise UserError(f"--tasks {item}: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
      raise UserError(f"--tasks {item}: not a task file (it has no `task:` name)")
    wrapper = {"include": path, "task": config["task"]}
    kwargs = config.get("dataset_kwargs")
    if isinstance(kwargs, dict):
      fixed = _relative_data_files(kwargs.get("data_files"), os.path.dirname(path))
      if fixed is not None:
        wrapper["dataset_kwargs"] = {**kwargs, "data_files": fixed}
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, f"{config['task']}.yaml"), "w") as f:
      yaml.safe_dump(wrapper, f)
    names.append(config["task"])
    include[:] = [work]
  return names, include, builtin


def summary(results: dict) -> str:
  parts = []
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      if isinstance(value, (int, float)) and "stderr" not in key and key != "sample_len":
        parts.append(f"{task} {key.removesuffix(',none')}={value:.4f}")
  return ", ".join(parts) or "no metrics"


def run(args: argparse.Namespace) -> int:
  try:  # outside the core dependencies: pip install -e '.[eval]' -c constraints.txt
    import lm_eval  # noqa: PLC0415 - the eval extra, not a core dependency
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 - the eval extra
    from lm_eval.utils import handle_non_serializable  # noqa: PLC0415 - the eval extra
  except ImportError as e:
    raise UserError(f"k3jax eval needs lm-evaluation-harness ({e}): "
                    "pip install -e '.[eval]' -c constraints.txt") from None
  items = [t for t in ",".join(args.tasks).split(",") if t]
  if not items:
    raise UserError("--tasks: name at least one task")
  out = os.path.abspath(args.out)
  names, include, builtin = resolve_tasks(items, os.path.join(out, "tasks"))
  server = build(engine_options(args, host="127.0.0.1", port=0))
  if server.service.tokenizer is None:
    raise UserError(f"{args.model}: the model has no tokenizer; the harness needs one "
                    "(--tokenizer FOLDER)")
  t0 = time.perf_counter()
  server.start()
  try:
    server.wait_ready()
    model_args = {"base_url": f"{server.url}/v1/completions",
                  "model": server.service.config.name, "tokenizer_backend": "remote",
                  "tokenized_requests": True, "num_concurrent": args.num_concurrent or
                  args.max_num_seqs, "max_length": server.service.config.max_model_len,
                  "max_gen_toks": args.max_gen_toks, "max_retries": 1}
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=names,
        num_fewshot=args.num_fewshot, limit=args.limit, log_samples=args.log_samples,
        task_manager=TaskManager(include_path=include or None, include_defaults=builtin))
  finally:
    server.stop()
  if results is None:
    raise UserError("the harness returned no results")
  os.makedirs(out, exist_ok=True)
  samples = results.pop("samples", None) or {}
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
  for task, rows in samples.items():
    with open(os.path.join(out, f"samples_{task}.jsonl"), "w") as f:
      f.writelines(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n"
                   for row in rows)
  n = sum(int(v.get("effective", v.get("original", 0))) if isinstance(v, dict) else 0
          for v in results.get("n-samples", {}).values())
  print(f"k3jax eval: {summary(results)} ({n} samples in {time.perf_counter() - t0:.1f}s) -> "
        f"{os.path.join(out, 'results.json')}", flush=True)
  return 0


def register(sub) -> None:
  p = sub.add_parser("eval", help="run lm-evaluation-harness tasks against a model",
                     description=__doc__, formatter_class=Formatter)
  p.add_argument("model", metavar="MODEL",
                 help="official folder, converted checkpoint, or `k3jax train` output folder")
  p.add_argument("--tasks", action="append", required=True, metavar="T1,T2",
                 help="task names and task YAML files (comma-separated; repeatable)")
  p.add_argument("--out", required=True, metavar="DIR", help="where results.json goes")
  p.add_argument("--limit", type=positive_int, default=None,
                 help="at most this many examples per task")
  p.add_argument("--num-fewshot", type=int, default=None,
                 help="few-shot examples per prompt (default: each task's own)")
  p.add_argument("--max-gen-toks", type=positive_int, default=256,
                 help="the most tokens a generation task may generate")
  p.add_argument("--num-concurrent", type=positive_int, default=None,
                 help="requests the harness keeps in flight (default: --max-num-seqs)")
  p.add_argument("--log-samples", action="store_true",
                 help="also write every sample (prompt, responses, scores) per task")
  add_tokenizer_flag(p)
  add_engine_flags(p, max_num_seqs=16)
  add_draft_flags(p)
  p.set_defaults(func=run)
