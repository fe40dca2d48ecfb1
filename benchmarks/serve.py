"""Serving: the engine (k3jax/engine) against the static left-padded batch, the prefix cache,
MXFP4 against bf16 experts, and the engine's decode step against reading the weights once.

    python benchmarks/serve.py                  # 64 requests, prompts 16-1024, outputs 8-256
    python benchmarks/serve.py --quick --json   # reduced sizes (minutes on a 2-core CPU)

On a small K3-shaped model ([KDA, KDA, KDA, MLA] blocks, dense first layer, LatentMoE, AttnRes;
K3's per-head sizes), weights and compute in --dtype (auto: float32 on a CPU, whose XLA backend
has no fast bf16 matmul, bf16 on an accelerator; as the commands' --dtype), greedy, every
request running to its max_tokens (no EOS), one process:

  (a) mixed: Poisson arrivals, prompt and output lengths uniform in their ranges (--lengths
      loguniform: log-uniform, heavy-tailed as serving traces are), on the engine and on the
      static batch (`StaticBatch`: requests in arrival order in batches of the engine's slot
      count, each started when its last request has arrived and the previous batch has ended;
      a batch pads its prompts to the longest and decodes until its longest output is done).
      The arrival rate is --load times the engine's estimated capacity (from its measured
      step times): above 1 both sides are saturated, so throughput measures what each can
      serve (at or below 1 both keep up and their throughputs are the arrival rate's).
      Throughput: output tokens over the time from the first arrival to the last token; per
      request, time to first token (from its arrival) and time per output token after the
      first; p50 / p99 over the requests.
  (b) shared prefix: every request is a long system prompt + a short question, all arriving at
      once, on the engine with and without the prefix cache (wall time).
  (c) the same model with its routed experts packed as MXFP4 codes + scales
      (`lora.adapt(base_experts="mxfp4")`) against --dtype: their device bytes (and over bf16),
      and the engine's decode and mixed (prefill) step times.
  (d) the engine's decode step at batch 1 and at its slot count against the time to read the
      active weights once (one [batch, 1024] @ [1024, n / 1024] matmul in --dtype, as in
      benchmarks/decode.py).

  (f) speculative decoding: greedy decode tokens/s at batch 1 and at the slot count, without
      a draft (decode blocks of 8) and verifying 4 drafts per step from: the model's own copy
      with MXFP4 experts (the named pair: a draft that reads a quarter of the expert bytes and
      nearly always agrees), the model itself (the upper bound: every draft kept), and prompt
      lookup on a repetitive workload (prompts of a repeated 16-token phrase); the mean
      accepted length (tokens emitted per verified row: drafts kept + 1) of each.

  (e) HTTP: the same greedy requests (prompts 16-128 tokens, outputs 16-32) from 1, 8 and 32
      closed-loop clients (each sends its next request when its last one is answered), through
      `k3jax serve`'s server (POST /v1/completions with token ids, not streamed, over loopback,
      clients in this process) and on the engine in process, both without the prefix cache:
      throughput and per-request latency p50 / p99. HTTP overhead: 1 - server throughput /
      engine throughput.

Arrivals run on the wall clock, except that time the system spends idle waiting for the next
arrival is skipped rather than slept; a request joins the engine at the first step after its
arrival. Every program either side runs is compiled in a warm-up first (its time is reported,
not counted), and the number of compilations during the timed runs is printed (0 expected).
Both sides decode in blocks of 8 steps per call (the static batch's design; the engine's
`decode_steps=8` once no prompt is being read), so a token is counted when its block arrives;
the engine's prefill rows are 256, 128, 64 or 32 wide (`prefill_widths=4`), one prompt read per
step unless --prefill-rows says more. (c) and (d) give the engine's decode time per step (a
block's time over its steps).

Goals: engine >= 2x the static batch's throughput on (a); prefix cache >= 1.5x on (b); (d)
within 2x; (e) HTTP overhead <= 10% of throughput at each concurrency. The last line with
--json is one JSON object (engine_vs_static_throughput, prefix_cache_speedup,
expert_bytes_mxfp4_over_bf16, http_overhead_fraction (the worst concurrency's),
spec_decode_speedup_batch1 and mean_accepted_length (the MXFP4 draft's, batch 1), ...).
`--sections f` runs only the sections named (a-f; (c) and (d) need (a)'s step times and run
with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs
from benchmarks.decode import active_weight_params, interleaved
from k3jax.engine import Engine, EngineConfig, SamplingParams
from k3jax.engine import runner as engine_runner
from k3jax.engine.drafts import ModelDrafter, NgramDrafter
from k3jax.engine.speculative import DraftRunner
from k3jax.execution import NUMERICS, resolve_dtype
from k3jax.generate import static_batch
from k3jax.generate.sampling import Sampling
from k3jax.model import lora
from k3jax.model.transformer import K3Model
from k3jax.server import Server
from k3jax.server.loop import EngineLoop
from k3jax.server.service import Service, ServiceConfig


@dataclasses.dataclass(frozen=True)
class Size:
  """One run's sizes: the model's widths and the workloads'."""
  hidden: int
  layers: int
  requests: int
  prompt: tuple[int, int]        # (a) prompt lengths, uniform in [lo, hi]
  output: tuple[int, int]        # (a) output lengths
  shared: int                    # (b) system prompt tokens
  shared_requests: int
  question: tuple[int, int]      # (b) tokens after the system prompt
  shared_output: int
  slots: int = 8
  http_requests: int = 64        # (e) per concurrency; prompts 16-128, outputs 16-32

  @property
  def max_model_len(self) -> int:
    return max(self.prompt[1] + self.output[1], self.shared + self.question[1] + self.shared_output)


FULL = Size(hidden=512, layers=12, requests=64, prompt=(16, 1024), output=(8, 256), shared=1024,
            shared_requests=32, question=(16, 64), shared_output=32)
QUICK = Size(hidden=256, layers=8, requests=32, prompt=(16, 512), output=(8, 128), shared=512,
             shared_requests=16, question=(16, 48), shared_output=16)
TINY = Size(hidden=128, layers=4, requests=8, prompt=(16, 128), output=(4, 16), shared=128,
            shared_requests=4, question=(8, 16), shared_output=4, slots=4, http_requests=8)


def model_config(size: Size):
  """K3's per-head sizes (KDA 128, MLA latent 512 + rope 64, nope 128, v 128), every 4th layer
  MLA, a dense first layer then LatentMoE (expert fan-in 256: a multiple of MXFP4's 32)."""
  mla = tuple(range(3, size.layers, 4))
  return configs.get("tiny").replace(
      vocab_size=8192, hidden_size=size.hidden, num_layers=size.layers, mla_layers=mla,
      kda_num_heads=size.hidden // 128, kda_head_dim=128, mla_num_heads=size.hidden // 128,
      q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
      v_head_dim=128, intermediate_size=3 * size.hidden, num_experts=16,
      num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=256, latent_size=256,
      attn_res_block_size=4)


def engine_config(size: Size, **kw) -> EngineConfig:
  """Decode rows always the slot count and the attention context always max_model_len (one
  bucket each, so few programs: decode-only, the decode block, and a mixed step per prefill
  width and prefill-row bucket; on a 2-core CPU each compile takes seconds). Decode blocks of 8
  steps, as the static batch's; prefill rows 256, 128, 64 or 32 wide (one prompt read per
  step unless `prefill_rows` says more)."""
  return EngineConfig(max_num_seqs=size.slots, max_model_len=size.max_model_len, page_size=64,
                      prefill_chunk=256, min_decode_rows=size.slots,
                      min_context=size.max_model_len, max_top_logprobs=1, decode_steps=8,
                      prefill_widths=4, **kw)


def random_model(cfg, dtype: str, seed: int = 0) -> K3Model:
  """The model in `dtype` with small random weights, built without running the initialisers."""
  model = nnx.eval_shape(lambda: K3Model(cfg, NUMERICS[dtype], rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for _, var in nnx.to_flat_state(nnx.state(model)):
    fan = var.shape[-2] if len(var.shape) >= 2 else 1
    var.set_value(jnp.asarray(rng.standard_normal(var.shape) / np.sqrt(fan), var.dtype))
  return model


@dataclasses.dataclass
class Req:
  id: str
  prompt: list[int]
  out: int
  arrival: float = 0.0
  first: float | None = None  # times on the run's clock
  done: float | None = None
  n: int = 0


def compiles() -> int:
  return (engine_runner._step._cache_size() + static_batch.extend_jit._cache_size()
          + static_batch.decode_block._cache_size())


class Clock:
  """Wall seconds since start, with idle waits skipped (`wait_until`) rather than slept."""

  def __init__(self):
    self.t0, self.skipped = time.perf_counter(), 0.0

  def __call__(self) -> float:
    return time.perf_counter() - self.t0 + self.skipped

  def wait_until(self, t: float) -> None:
    self.skipped += max(0.0, t - self())


def run_engine(engine: Engine, reqs: list[Req], step_log: list | None = None) -> float:
  """Serve `reqs` (sorted by arrival); returns the run's duration on its clock."""
  byid, i, clock = {r.id: r for r in reqs}, 0, Clock()
  greedy = dict(temperature=0.0, ignore_eos=True)
  while i < len(reqs) or engine.has_work():
    if not engine.has_work():
      clock.wait_until(reqs[i].arrival)
    while i < len(reqs) and reqs[i].arrival <= clock():
      engine.add(reqs[i].id, reqs[i].prompt, SamplingParams(max_tokens=reqs[i].out, **greedy))
      i += 1
    mixed = bool(engine.scheduler.waiting) or any(r.to_feed > 1 for r in engine.scheduler.running)
    t = clock()
    outs = engine.step()
    now = clock()
    if step_log is not None:  # (prompt read?, seconds, decode steps run: a block runs several)
      step_log.append((mixed, now - t, max([len(o.token_ids) for o in outs] + [1])))
    for o in outs:
      r = byid[o.request_id]
      if o.token_ids and r.first is None:
        r.first = now
      r.n += len(o.token_ids)
      if o.finish_reason is not None:
        r.done = now
  return clock()


def run_static(gen: static_batch.StaticBatch, reqs: list[Req], slots: int) -> float:
  clock, greedy = Clock(), Sampling.make()
  for b in range(0, len(reqs), slots):
    batch = reqs[b:b + slots]
    clock.wait_until(batch[-1].arrival)
    for block in gen.stream([r.prompt for r in batch], max_new_tokens=max(r.out for r in batch),
                            sampling=greedy):
      now = clock()
      for r, row in zip(batch, block):
        got = min(r.out - r.n, int((row >= 0).sum()))
        if got and r.first is None:
          r.first = now
        r.n += got
        if r.n == r.out and r.done is None:
          r.done = now
  return clock()


def warm_static(gen: static_batch.StaticBatch, reqs: list[Req], slots: int, vocab: int) -> None:
  """Compile the static batch's programs for every batch of `reqs` (same shapes: prefill chunk,
  cache length, rows) by running each batch's prefill on one chunk and one decode block."""
  seen = set()
  for b in range(0, len(reqs), slots):
    batch = reqs[b:b + slots]
    longest, new = max(len(r.prompt) for r in batch), max(r.out for r in batch)
    chunk = gen.chunk_for(longest)
    key = (len(batch), chunk, gen.max_len(longest, new))
    if key in seen:
      continue
    seen.add(key)
    padded = longest + -longest % chunk  # one chunk of prompt, the same cache length
    prompts = [[1 + i % (vocab - 1)] * chunk for i in range(len(batch))]
    stream = gen.stream(prompts, max_new_tokens=padded + new - chunk, sampling=Sampling.make())
    next(stream)
    stream.close()


def warm_engine(engine: Engine, size: Size) -> None:
  """Run the programs the workloads use: mixed steps of every prefill width and prefill-row
  bucket, decode-only steps and blocks, at every context bucket (a long request decoding
  through the buckets while short ones are prefilled beside it)."""
  cfg = engine.config
  widths = sorted({cfg.prefill_width(n) for n in range(1, cfg.prefill_chunk + 1)})
  for k, (n, rows) in enumerate((n, r) for n in widths for r in cfg.prefill_row_counts):
    for j in range(rows):  # `rows` prompts of width n read together (distinct: no prefix hit)
      # two tokens: the mixed step draws the first, a one-step decode-only call the second
      # (a row of width n holds prompts longer than n / 2: within max_model_len, that width)
      length = min(n, cfg.max_model_len - 2)
      engine.add(f"p{k}.{j}", [2 + 8 * k + j] * length,
                 SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_work():
      engine.step()
  long_prompt = cfg.min_context - 4
  engine.add("w0", [1] * long_prompt, SamplingParams(max_tokens=cfg.max_model_len - long_prompt
                                                      - 1, ignore_eos=True))
  k = 0
  while engine.has_work():
    running = {r.id: len(r.tokens) for r in engine.scheduler.running}
    if k < 3 and running.get("w0", 0) > cfg.min_context + 2 * k:
      engine.add(f"w{k + 1}", [2 + k] * 8, SamplingParams(max_tokens=2, ignore_eos=True))
      k += 1
    engine.step()


def length(rng, lo: int, hi: int, lengths: str) -> int:
  """A length in [lo, hi]: uniform, or log-uniform (heavy-tailed: as many in [lo, 2 lo] as in
  [hi / 2, hi])."""
  if lengths == "uniform":
    return int(rng.integers(lo, hi + 1))
  return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def mixed_workload(size: Size, rate: float, vocab: int, seed: int,
                   lengths: str = "uniform") -> list[Req]:
  rng = np.random.default_rng(seed)
  t, reqs = 0.0, []
  for i in range(size.requests):
    n = length(rng, *size.prompt, lengths)
    reqs.append(Req(f"m{i}", rng.integers(1, vocab, n).tolist(),
                    length(rng, *size.output, lengths), t))
    t += rng.exponential(1 / rate)
  return reqs


def shared_workload(size: Size, vocab: int, seed: int) -> list[Req]:
  rng = np.random.default_rng(seed + 1)
  system = rng.integers(1, vocab, size.shared).tolist()
  return [Req(f"s{i}", system + rng.integers(1, vocab, int(rng.integers(*size.question))
                                             ).tolist(), size.shared_output)
          for i in range(size.shared_requests)]


def copies(reqs: list[Req]) -> list[Req]:
  return [Req(r.id, r.prompt, r.out, r.arrival) for r in reqs]


def latency(reqs: list[Req], seconds: float) -> dict:
  ttft = [r.first - r.arrival for r in reqs]
  tpot = [(r.done - r.first) / (r.n - 1) for r in reqs if r.n > 1]
  pct = lambda xs, q: float(np.percentile(xs, q))
  return {"tokens_per_s": sum(r.n for r in reqs) / (seconds - min(r.arrival for r in reqs)),
          "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
          "tpot_p99": pct(tpot, 99), "seconds": seconds}


def http_workload(size: Size, vocab: int, seed: int) -> list[Req]:
  rng = np.random.default_rng(seed + 2)
  return [Req(f"h{i}", rng.integers(1, vocab, int(rng.integers(16, 129))).tolist(),
              int(rng.integers(16, 33))) for i in range(size.http_requests)]


def closed_loop(reqs: list[Req], seconds: float) -> dict:
  lat = [r.done - r.arrival for r in reqs]
  return {"tokens_per_s": sum(r.n for r in reqs) / seconds,
          "latency_p50": float(np.percentile(lat, 50)),
          "latency_p99": float(np.percentile(lat, 99)), "seconds": seconds}


def closed_loop_engine(engine: Engine, reqs: list[Req], concurrency: int) -> dict:
  """`concurrency` clients in process: a request is added when the last one of its client
  has finished (at the step that finished it)."""
  byid, todo, clock = {r.id: r for r in reqs}, list(reversed(reqs)), Clock()
  greedy = dict(temperature=0.0, ignore_eos=True)

  def send() -> None:
    r = todo.pop()
    r.arrival = clock()
    engine.add(r.id, r.prompt, SamplingParams(max_tokens=r.out, **greedy))
  for _ in range(min(concurrency, len(todo))):
    send()
  while engine.has_work():
    for o in engine.step():
      r = byid[o.request_id]
      r.n += len(o.token_ids)
      if o.finish_reason is not None:
        r.done = clock()
        if todo:
          send()
  return closed_loop(reqs, clock())


def closed_loop_http(server: Server, reqs: list[Req], concurrency: int) -> dict:
  """`concurrency` client threads, each on its own keep-alive connection, sending requests
  one after the other."""
  todo, lock, t0 = list(reversed(reqs)), threading.Lock(), time.perf_counter()
  errors: list[str] = []

  def client() -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
      while True:
        with lock:
          if not todo:
            return
          r = todo.pop()
        body = json.dumps({"model": "bench", "prompt": r.prompt, "max_tokens": r.out,
                           "temperature": 0})
        r.arrival = time.perf_counter() - t0
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        r.done = time.perf_counter() - t0
        if resp.status != 200:
          errors.append(f"{resp.status}: {data}")
          return
        r.n = data["usage"]["completion_tokens"]
    finally:
      conn.close()
  threads = [threading.Thread(target=client) for _ in range(min(concurrency, len(reqs)))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise RuntimeError(f"the server refused a request: {errors[0]}")
  return closed_loop(reqs, time.perf_counter() - t0)


def serve_in_process(engine: Engine, max_model_len: int) -> Server:
  """`k3jax serve`'s server (app, engine loop, uvicorn) around `engine`, on a free loopback
  port, no tokenizer (token-id prompts), no EOS."""
  service = Service(ServiceConfig(name="bench", max_model_len=max_model_len),
                    EngineLoop(lambda: engine))
  server = Server(service, "127.0.0.1", 0).start()
  server.wait_ready(600)
  return server


def expert_bytes(model) -> tuple[int, int]:
  """(device bytes of the routed experts' weights as held, their size in bf16)."""
  held = bf16 = 0
  for ex in lora.expert_paths(model).values():
    for w in lora.EXPERT_WEIGHTS:
      bf16 += 2 * math.prod(lora.expert_shape(ex, w))
      parts = [f"{w}_packed", f"{w}_scale"] if hasattr(ex, f"{w}_packed") else [w]
      held += sum(getattr(ex, p)[...].nbytes for p in parts)
  return held, bf16


def step_times(engine: Engine, n: int, vocab: int, out: int = 16) -> dict:
  """Median seconds of the engine's decode-only and mixed steps over `n` requests of
  min_context / 2 prompt tokens and `out` outputs arriving at once."""
  prompt = engine.config.min_context // 2
  rng = np.random.default_rng(7)
  log = []
  reqs = [Req(f"t{i}", rng.integers(1, vocab, prompt).tolist(), out) for i in range(n)]
  run_engine(engine, reqs, log)
  # a decode block's time per decode step (the blocks' lengths vary as requests near their end)
  pick = lambda m: statistics.median([t / n for mixed, t, n in log if mixed == m] or [math.nan])
  return {"decode_step_s": pick(False), "mixed_step_s": pick(True)}


def weights_bound(n_params: int, batch: int, reps: int, dtype: str) -> float:
  """Seconds of one [batch, 1024] @ [1024, n / 1024] matmul in `dtype`: reading n weights
  once."""
  w = jnp.asarray(np.random.default_rng(0).standard_normal((1024, n_params // 1024)), dtype)
  x = jnp.ones((batch, 1024), dtype)
  f = jax.jit(lambda x, w: x @ w)
  jax.block_until_ready(f(x, w))
  return interleaved({"matmul": lambda: f(x, w)}, reps)["matmul"][0]


def timed_warmup(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def show(name: str, m: dict) -> None:
  print(f"  {name:<22} {m['tokens_per_s']:>9.1f} {1e3 * m['ttft_p50']:>9.0f} "
        f"{1e3 * m['ttft_p99']:>9.0f} {1e3 * m['tpot_p50']:>9.1f} {1e3 * m['tpot_p99']:>9.1f} "
        f"{m['seconds']:>8.1f}", flush=True)


def goal(text: str, value: float, met: bool, why: str = "") -> None:
  print(f"goal: {text}: {value:.2f}x {'MET' if met else 'NOT MET'}" + (f" ({why})" if why and
                                                                       not met else ""))


SPEC_DRAFTS = 4


def spec_decode(make, prompts: list[list[int]], out: int) -> dict:
  """Greedy decode tokens/s of `prompts` served together on `make()`'s engine (the clock runs
  from the step after every prompt was read to the last token), and its mean accepted
  length."""
  engine = make()
  for i, p in enumerate(prompts):
    engine.add(str(i), p, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
  while engine.scheduler.waiting or any(r.to_feed > 1 or not r.output_len
                                         for r in engine.scheduler.running):
    engine.step()
  t0 = time.perf_counter()
  decoded = 0
  while engine.has_work():
    decoded += sum(len(o.token_ids) for o in engine.step())
  seconds = time.perf_counter() - t0
  return {"tokens_per_s": decoded / seconds, "mean_accepted_length":
          engine.stats()["mean_accepted_length"], "seconds": seconds}


def spec_section(size: Size, model, config: EngineConfig, vocab: int, seed: int) -> dict:
  """(f): decode tokens/s and accepted lengths with and without drafts, batch 1 and slots."""
  spec = dataclasses.replace(config, num_draft_tokens=SPEC_DRAFTS)
  packed = lora.adapt(nnx.clone(model), lora.AdaptSpec(base_experts="mxfp4"), nnx.Rngs(0))
  rng = np.random.default_rng(seed)
  out = size.output[1]
  random_prompts = [rng.integers(0, vocab, size.prompt[0] * 4).tolist() for _ in range(size.slots)]
  phrase = rng.integers(0, vocab, 16).tolist()
  repeated = [(phrase * 8)[:size.prompt[0] * 4] for _ in range(size.slots)]
  drafters = {"none": (config, lambda: None, random_prompts),
              "mxfp4 draft": (spec, lambda: ModelDrafter(DraftRunner(packed, spec), SPEC_DRAFTS),
                              random_prompts),
              "self draft": (spec, lambda: ModelDrafter(DraftRunner(model, spec), SPEC_DRAFTS),
                             random_prompts),
              "none (repetitive)": (config, lambda: None, repeated),
              "ngram (repetitive)": (spec, lambda: NgramDrafter(SPEC_DRAFTS), repeated)}
  res = {}
  for name, (cfg, drafter, prompts) in drafters.items():
    make = lambda cfg=cfg, drafter=drafter: Engine(model, cfg, drafter=drafter())
    for batch in (1, size.slots):
      spec_decode(make, prompts[:batch], 8)  # compile
      res[f"{name} @{batch}"] = spec_decode(make, prompts[:batch], out)
  print(f"(f) speculative decoding ({SPEC_DRAFTS} drafts per step; greedy, {out} tokens per "
        "request; decode tokens/s, mean accepted length):")
  for name, r in res.items():
    print(f"  {name:<28} {r['tokens_per_s']:>9.1f} tok/s   accepted "
          f"{r['mean_accepted_length']:.2f}")
  speedup = res["mxfp4 draft @1"]["tokens_per_s"] / res["none @1"]["tokens_per_s"]
  return {"spec_decode_speedup_batch1": speedup,
          "mean_accepted_length": res["mxfp4 draft @1"]["mean_accepted_length"], "spec": res}


def classic_sections(args, size: Size, model, config: EngineConfig, dtype: str) -> dict:
  """(a) to (e); their JSON keys."""
  cfg, vocab = model.cfg, model.cfg.vocab_size
  # compile everything first
  engine = lambda m=model, **kw: Engine(m, dataclasses.replace(config, **kw))
  compile_s = {"engine": timed_warmup(lambda: warm_engine(engine(), size)),
               "engine_no_prefix": timed_warmup(lambda: warm_engine(engine(prefix_cache=False),
                                                                    size))}
  print(f"warm-up: {compile_s}", file=sys.stderr, flush=True)
  step_times(engine(), size.slots, vocab)
  dense_steps = step_times(engine(), size.slots, vocab)

  # (a) mixed: arrivals at the engine's estimated capacity
  probe = mixed_workload(size, 1.0, vocab, args.seed, args.lengths)
  # mixed steps: the prompts' chunks, `prefill_rows` of them per step (step_times reads 8
  # prompts at once, so its mixed step reads as many as the engine allows)
  est = (math.ceil(sum(-(-len(r.prompt) // config.prefill_chunk) + 1 for r in probe)
                   / config.prefill_rows) * dense_steps["mixed_step_s"]
         + sum(r.out for r in probe) / size.slots * dense_steps["decode_step_s"])
  rate = args.load * size.requests / est
  work = mixed_workload(size, rate, vocab, args.seed, args.lengths)
  gen = static_batch.StaticBatch(model)
  compile_s["static"] = timed_warmup(lambda: warm_static(gen, work, size.slots, vocab))
  before = compiles()
  reqs = {"engine": copies(work), "static": copies(work)}
  res = {"engine": latency(reqs["engine"], run_engine(engine(), reqs["engine"])),
         "static": latency(reqs["static"], run_static(gen, reqs["static"], size.slots))}
  print(f"(a) mixed: {size.requests} requests, Poisson arrivals at {rate:.2f}/s ({args.load:g}x "
        f"the engine's estimated capacity), prompts {size.prompt[0]}-{size.prompt[1]}, outputs "
        f"{size.output[0]}-{size.output[1]}, {args.lengths}")
  print(f"  {'':<22} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'wall s':>8}   (ms)")
  show("engine", res["engine"])
  show("static batch", res["static"])

  # (b) shared prefix, all at once
  shared = shared_workload(size, vocab, args.seed)
  for name, kw in (("prefix cache", {}), ("no prefix cache", {"prefix_cache": False})):
    rs = copies(shared)
    res[name] = latency(rs, run_engine(engine(**kw), rs))
  print(f"(b) shared prefix: {size.shared_requests} requests at once, a {size.shared}-token "
        f"system prompt + {size.question[0]}-{size.question[1]} tokens, {size.shared_output} "
        f"outputs each")
  show("prefix cache", res["prefix cache"])
  show("no prefix cache", res["no prefix cache"])
  timed_compiles = compiles() - before

  # (c) MXFP4 experts
  packed = lora.adapt(nnx.clone(model), lora.AdaptSpec(base_experts="mxfp4"), nnx.Rngs(0))
  compile_s["engine_mxfp4"] = timed_warmup(lambda: step_times(engine(packed), size.slots, vocab))
  mx_steps = step_times(engine(packed), size.slots, vocab)
  held_dense, size_bf16 = expert_bytes(model)
  held_mx, _ = expert_bytes(packed)
  print(f"(c) routed experts: {dtype} {held_dense / 2**20:.1f} MiB, bf16 {size_bf16 / 2**20:.1f}"
        f" MiB, MXFP4 codes + scales {held_mx / 2**20:.1f} MiB ({held_mx / size_bf16:.3f} of "
        f"bf16); engine step with {size.slots} requests, ms ({dtype} / MXFP4): decode "
        f"{1e3 * dense_steps['decode_step_s']:.1f}"
        f" / {1e3 * mx_steps['decode_step_s']:.1f}, mixed (+ a 256-token prefill chunk) "
        f"{1e3 * dense_steps['mixed_step_s']:.1f} / {1e3 * mx_steps['mixed_step_s']:.1f}")

  # (d) the decode step against reading the active weights once
  one = lambda: engine(min_decode_rows=1)
  step_times(one(), 1, vocab)
  b1 = step_times(one(), 1, vocab)["decode_step_s"]
  n_active = active_weight_params(cfg)
  bounds = {1: weights_bound(n_active, 1, args.reps, dtype),
            size.slots: weights_bound(n_active, size.slots, args.reps, dtype)}
  decode = {1: b1, size.slots: dense_steps["decode_step_s"]}
  print(f"(d) decode step vs reading the {n_active / 1e6:.1f}M active weights once ({dtype} "
        "matmul):")
  for b in bounds:
    print(f"  batch {b}: engine step {1e3 * decode[b]:.2f} ms, bound {1e3 * bounds[b]:.2f} ms, "
          f"{decode[b] / bounds[b]:.2f}x")

  # (e) HTTP against the engine in process, closed loop
  # Both sides without the prefix cache: every concurrency sends the same prompts, which the
  # server's one engine would otherwise have cached from the runs before.
  work = http_workload(size, vocab, args.seed)
  server = serve_in_process(engine(prefix_cache=False), config.max_model_len)
  closed_loop_http(server, copies(work)[:size.slots], size.slots)  # warm: connections, app
  before = compiles()
  http_res, worst_overhead = {}, 0.0
  try:
    for c in (1, 8, 32):
      mine, theirs = copies(work), copies(work)
      http_res[str(c)] = {"engine": closed_loop_engine(engine(prefix_cache=False), mine, c),
                          "http": closed_loop_http(server, theirs, c)}
      if [r.n for r in mine] != [r.n for r in theirs]:
        raise RuntimeError("the server's completions differ in length from the engine's")
      e, h = (http_res[str(c)][k]["tokens_per_s"] for k in ("engine", "http"))
      http_res[str(c)]["overhead"] = 1 - h / e
      worst_overhead = max(worst_overhead, 1 - h / e)
  finally:
    server.stop()
  http_compiles = compiles() - before
  print(f"(e) HTTP: {size.http_requests} requests per concurrency, prompts 16-128, outputs 16-32,"
        f" closed loop, no prefix cache; compilations during the timed runs: {http_compiles}")
  print(f"  {'clients':>7} {'engine tok/s':>13} {'HTTP tok/s':>11} {'overhead':>9} "
        f"{'engine p50':>11} {'HTTP p50':>9} {'engine p99':>11} {'HTTP p99':>9}   (ms)")
  for c, m in http_res.items():
    e, h = m["engine"], m["http"]
    print(f"  {c:>7} {e['tokens_per_s']:>13.1f} {h['tokens_per_s']:>11.1f} "
          f"{100 * m['overhead']:>8.1f}% {1e3 * e['latency_p50']:>11.0f} "
          f"{1e3 * h['latency_p50']:>9.0f} {1e3 * e['latency_p99']:>11.0f} "
          f"{1e3 * h['latency_p99']:>9.0f}")

  print("compile (warm-up, not timed), s: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                         compile_s.items())
        + f"; compilations during the timed runs of (a) and (b): {timed_compiles}")
  ratio = res["engine"]["tokens_per_s"] / res["static"]["tokens_per_s"]
  speedup = res["no prefix cache"]["seconds"] / res["prefix cache"]["seconds"]
  goal("engine / static batch throughput on (a) >= 2x", ratio, ratio >= 2)
  goal("prefix cache speedup on (b) >= 1.5x", speedup, speedup >= 1.5)
  worst = max(decode[b] / bounds[b] for b in bounds)
  goal("engine decode step within 2x of reading the weights once (worst of batch 1 and "
       f"{size.slots})", worst, worst <= 2)
  goal("HTTP throughput over the engine's in process (worst of 1, 8, 32 clients) >= 0.90x",
       1 - worst_overhead, worst_overhead <= 0.10)
  return {
        "engine_vs_static_throughput": ratio, "prefix_cache_speedup": speedup,
        "expert_bytes_mxfp4_over_bf16": held_mx / size_bf16,
        "engine": res["engine"], "static": res["static"],
        "prefix_cache": res["prefix cache"], "no_prefix_cache": res["no prefix cache"],
        "dtype": dtype,
        "decode_step_s": {dtype: dense_steps["decode_step_s"], "mxfp4": mx_steps["decode_step_s"]},
        "mixed_step_s": {dtype: dense_steps["mixed_step_s"], "mxfp4": mx_steps["mixed_step_s"]},
        "decode_vs_weights_bound": {str(b): decode[b] / bounds[b] for b in bounds},
        "http_overhead_fraction": worst_overhead, "http": http_res,
        "http_timed_compiles": http_compiles,
        "arrival_rate_per_s": rate, "lengths": args.lengths, "compile_s": compile_s,
        "timed_compiles": timed_compiles,
        "quick": args.quick}

def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="reduced model and workloads")
  p.add_argument("--tiny", action="store_true", help="a smoke run of the script (no measurement)")
  p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--load", type=float, default=4.0,
                 help="(a)'s arrival rate over the engine's estimated capacity")
  p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                 help="weights and compute (auto: float32 on a CPU, whose XLA backend has no "
                      "fast bf16 matmul, bfloat16 on an accelerator; as the commands' --dtype)")
  p.add_argument("--prefill-rows", type=int, default=1,
                 help="the engine's prompts read per step, at most (as `k3jax serve`'s flag)")
  p.add_argument("--lengths", choices=("uniform", "loguniform"), default="uniform",
                 help="(a)'s prompt and output lengths in their ranges: uniform, or "
                      "log-uniform (heavy-tailed, as serving traces are)")
  p.add_argument("--reps", type=int, default=7, help="repetitions of the weight-reading matmul")
  p.add_argument("--sections", default="abcdef",
                 help="the sections to run (a-e run together; f: speculative decoding)")
  args = p.parse_args(argv)
  size = TINY if args.tiny else QUICK if args.quick else FULL
  cfg = model_config(size)
  vocab = cfg.vocab_size
  dtype = resolve_dtype(args.dtype)
  model = random_model(cfg, dtype, args.seed)
  config = engine_config(size, prefill_rows=args.prefill_rows)
  print(f"platform {jax.default_backend()}, {os.cpu_count()} CPUs; {dtype}; model "
        f"d={cfg.hidden_size}, {cfg.num_layers} layers (MLA at {list(cfg.mla_layers)}), "
        f"{cfg.num_experts} experts top {cfg.num_experts_per_token}; engine: {size.slots} "
        f"slots, max_model_len {config.max_model_len}, prefill chunk {config.prefill_chunk} (up "
        f"to {config.prefill_rows} rows), page {config.page_size}",
        flush=True)

  result = {"dtype": dtype, "quick": args.quick}
  if set(args.sections) - {"f"}:
    result.update(classic_sections(args, size, model, config, dtype))
  if "f" in args.sections:
    result.update(spec_section(size, model, config, vocab, args.seed))
  if args.json:
    print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
