"""The training input at corpus scale: what a prepared dataset costs to open, what the pipeline
delivers against what a K3 step needs, and what `k3jax prepare-data` tokenizes.

    python benchmarks/data.py [--tokenizer MODEL_DIR] [--small-tokens 20000000] [--scale 10]
        [--seq 8192] [--rows 16] [--seconds 20] [--step-seconds S] [--json]

1. Two synthetic prepared corpora (random ids of a 163,840-id vocabulary, document lengths
   log-uniform in [64, 16384) tokens), `--small-tokens` and `--scale` times as many (default
   20M and 200M tokens), written once under --dir. For each, a fresh process opens it as
   `k3jax train --data DIR` does (manifest, hold-out, eval batches) and produces the first
   batch: its start-up seconds (imports done) and peak RSS, the median of --repeats fresh
   processes each, taken in turn (goal: larger / smaller <= 1.2 for both).
2. Training-side tokens/s of one process (one data shard: the rows of `--rows` x `--seq` every
   batch, counted as the step consumes them) with 1 and 4 Grain worker processes
   (`--data-workers`), on the larger corpus, against the tokens per second per host of the K3
   step: global batch 512 x 8192 over the step time of `k3jax plan --config k3 --topology
   v5p:8x8x16 --batch 512 --seq 8192 --analytic` (or --step-seconds), 4 chips per v5p host
   (goal >= 10x). That need assumes `--data-shards` >= hosts, so that a process packs its own
   rows only; with one data shard every host packs the whole global batch (printed too).
3. `k3jax prepare-data` throughput with the BPE of --tokenizer (a model folder with
   tiktoken.model and tokenization_*.py) on this interpreter's standard-library sources as
   JSONL rows: BPE tokens/s per worker with 1 and 4 workers, the tokens/s of its one shard
   writing process (on tokenized documents), and the hours 1T tokens take on one 64-core host:
   64 workers at the 1-worker rate, capped by the writer. Without --tokenizer this part is
   skipped.

`--json` ends with one JSON line: startup_ratio, rss_ratio, tokens_per_s_per_process ({workers:
tokens/s}), step_need_tokens_per_s_per_host, prepare_tokens_per_s_per_worker ({workers:
tokens/s}), and the figures behind them. A script, not a test: the default corpora take a few
GB of disk and minutes to write.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

from k3jax.corpus import manifest as manifest_lib
from k3jax.corpus import mixture
from k3jax.corpus.prepare import PrepareOptions, prepare, write_documents
from k3jax.train import data, inputs

VOCAB = 163_840
K3_BATCH, K3_SEQ, V5P_CHIPS_PER_HOST = 512, 8192, 4


class SyntheticTokenizer:
  """What a prepared dataset records of its tokenizer, for random ids of K3's vocabulary."""
  name = "synthetic"
  fingerprint = f"synthetic-{VOCAB}"
  vocab_size = VOCAB
  eos_id = VOCAB - 1

  def decode_bytes(self, ids) -> bytes:
    return b"<eos>"


def synthetic_documents(tokens: int, seed: int):
  rng = np.random.default_rng(seed)
  left = tokens
  while left > 0:
    n = min(left, int(np.exp(rng.uniform(np.log(64), np.log(16384)))))
    ids = rng.integers(0, VOCAB - 1, n, dtype=np.uint32)
    ids[-1] = VOCAB - 1
    left -= n
    yield ids


def corpus(root: str, tokens: int) -> str:
  folder = os.path.join(root, f"synthetic_{tokens}")
  if manifest_lib.is_prepared(folder) and manifest_lib.read(folder).get("complete"):
    return folder
  t0 = time.perf_counter()
  write_documents(folder, synthetic_documents(tokens, seed=tokens % 9973),
                  SyntheticTokenizer(), shard_tokens=64 << 20)
  print(f"wrote {folder}: {tokens:,} tokens in {time.perf_counter() - t0:.0f}s", flush=True)
  return folder


def pipeline(folder: str, seq: int, rows: int, workers: int):
  """(the run's TrainingData, its ShardIterator) as `k3jax train --data folder` builds them."""
  cfg = data.PipelineConfig(seq_len=seq, batch_rows=rows, micro_batches=1, seed=0)
  training = inputs.load_training_data(None, "text", SyntheticTokenizer(), cfg, 1,
                                       mix=mixture.single(folder), workers=workers)
  return training, training.iterator(cfg)


def probe(folder: str, seq: int, rows: int) -> None:
  """In a fresh process (its imports done): seconds from opening the dataset to the first
  batch, and the process's peak RSS."""
  t0 = time.perf_counter()
  _, it = pipeline(folder, seq, rows, workers=0)
  next(it)
  seconds = time.perf_counter() - t0
  it.close()
  print(json.dumps({"startup_s": seconds,
                    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def probed(folder: str, seq: int, rows: int) -> dict:
  out = subprocess.run([sys.executable, __file__, "--probe", folder, "--seq", str(seq),
                        "--rows", str(rows)], capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def startups(folders: dict[str, str], seq: int, rows: int, repeats: int) -> dict:
  """The median start-up and peak RSS of `repeats` probes of each folder, taken in turn (a
  shared machine's load drifts: alternating keeps it alike for both sizes)."""
  runs = {k: [] for k in folders}
  for _ in range(repeats):
    for k, folder in folders.items():
      runs[k].append(probed(folder, seq, rows))
  return {k: {key: float(np.median([r[key] for r in v])) for key in v[0]}
          for k, v in runs.items()}


def throughput(folder: str, seq: int, rows: int, workers: int, seconds: float) -> float:
  """Batch positions per second one process delivers, after the first batch."""
  _, it = pipeline(folder, seq, rows, workers)
  next(it)
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    next(it)
    n += 1
  rate = n * rows * seq / (time.perf_counter() - t0)
  it.close()
  return rate


def k3_step_seconds() -> float:
  from k3jax import plan
  plans = plan.run(plan.PlanRequest(config="k3", topology="v5p:8x8x16", batch=K3_BATCH,
                                    seq=K3_SEQ, analytic=True))
  return plan.best(plans).step_seconds_estimate


def stdlib_jsonl(path: str, megabytes: int) -> None:
  texts = []
  for f in sorted(glob.glob(os.path.join(sysconfig.get_path("stdlib"), "*.py"))):
    with open(f, encoding="utf-8", errors="replace") as fh:
      texts.append(fh.read())
  size = 0
  with open(path, "w") as out:
    while size < megabytes << 20:
      for t in texts:
        out.write(json.dumps({"text": t}) + "\n")
        size += len(t)


def prepare_rate(tokenizer: str, root: str, workers: int, megabytes: int) -> float:
  src = os.path.join(root, "stdlib.jsonl")
  if not os.path.exists(src):
    stdlib_jsonl(src, megabytes)
  with tempfile.TemporaryDirectory(dir=root) as out:
    s = prepare(PrepareOptions(sources=(src,), out=os.path.join(out, "p"), tokenizer=tokenizer,
                               workers=workers, progress=False))
  return s["tokens_per_s"] / workers


def writer_rate(root: str, tokens: int) -> float:
  """Tokens/s prepare-data's main process stores (shard writing: one process, whatever the
  worker count), on documents already tokenized."""
  docs = list(synthetic_documents(tokens, seed=1))
  with tempfile.TemporaryDirectory(dir=root) as out:
    t0 = time.perf_counter()
    write_documents(os.path.join(out, "w"), docs, SyntheticTokenizer(), shard_tokens=64 << 20)
    return tokens / (time.perf_counter() - t0)


def hours_for_1t(per_worker: float, writer: float, cores: int = 64) -> float:
  """1T tokens on one host: its workers' rate, capped by the one process writing shards."""
  return 1e12 / min(per_worker * cores, writer) / 3600


def measure(a) -> dict:
  os.makedirs(a.dir, exist_ok=True)
  small, large = (corpus(a.dir, a.small_tokens), corpus(a.dir, a.small_tokens * a.scale))
  starts = startups({"small": small, "large": large}, a.seq, a.rows, a.repeats)
  mib = [starts[k]["peak_rss_bytes"] / 2**20 for k in ("small", "large")]
  print(f"start-up to the first batch: {starts['small']['startup_s']:.2f}s / "
        f"{starts['large']['startup_s']:.2f}s, peak RSS {mib[0]:.0f} / {mib[1]:.0f} MiB "
        "(small / large)", flush=True)
  rates = {w: throughput(large, a.seq, a.rows, w, a.seconds) for w in (1, 4)}
  step_s = a.step_seconds or k3_step_seconds()
  hosts = 1024 // V5P_CHIPS_PER_HOST
  need = K3_BATCH * K3_SEQ / step_s / hosts
  for w, r in rates.items():
    print(f"{w} worker(s): {r:,.0f} tokens/s per process = {r / need:.0f}x the K3 step's "
          f"{need:,.0f} tokens/s per host ({step_s:.2f}s step, {hosts} hosts); "
          f"{r / (need * hosts):.2f}x what a host packing the whole global batch needs",
          flush=True)
  prep = {w: prepare_rate(a.tokenizer, a.dir, w, a.prepare_mb) for w in (1, 4)} \
      if a.tokenizer else None
  writer = writer_rate(a.dir, a.small_tokens)
  hours = hours_for_1t(prep[1], writer) if prep else None
  if prep:
    print(f"prepare-data: {prep[1]:,.0f} / {prep[4]:,.0f} BPE tokens/s per worker (1 / 4 "
          f"workers), shard writing {writer:,.0f} tokens/s; 1T tokens on one 64-core host: "
          f"{hours:.1f} h ({'the writer' if writer < prep[1] * 64 else 'the workers'} bound)")
  return {"startup_ratio": starts["large"]["startup_s"] / starts["small"]["startup_s"],
          "rss_ratio": starts["large"]["peak_rss_bytes"] / starts["small"]["peak_rss_bytes"],
          "tokens_per_s_per_process": rates, "step_need_tokens_per_s_per_host": need,
          "prepare_tokens_per_s_per_worker": prep, "startup": starts,
          "corpus_tokens": [a.small_tokens, a.small_tokens * a.scale], "k3_step_s": step_s,
          "prepare_writer_tokens_per_s": writer, "prepare_hours_1t_64_cores": hours}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "k3jax_data_bench"))
  p.add_argument("--small-tokens", type=int, default=20_000_000)
  p.add_argument("--scale", type=int, default=10)
  p.add_argument("--seq", type=int, default=K3_SEQ)
  p.add_argument("--rows", type=int, default=16, help="rows per batch of the one data shard")
  p.add_argument("--seconds", type=float, default=20.0, help="each throughput measurement")
  p.add_argument("--repeats", type=int, default=5, help="start-up probes of each corpus")
  p.add_argument("--step-seconds", type=float, default=None,
                 help="the K3 step time (none given: k3jax plan --analytic, minutes)")
  p.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                 help="a BPE model folder for the prepare-data part (none: skipped)")
  p.add_argument("--prepare-mb", type=int, default=64, help="text prepared per measurement")
  p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
  p.add_argument("--json", action="store_true")
  a = p.parse_args()
  if a.probe:
    probe(a.probe, a.seq, a.rows)
    return
  result = measure(a)
  if a.json:
    print(json.dumps(result))


if __name__ == "__main__":
  main()
