"""One command for a short window on one NVIDIA GPU: the KDA kernels, the grouped matmul, a
train step and the engine's decode step, measured and checked on the device.

    python benchmarks/device_check.py --out $OUT                  # on the GPU, 300 s at most
    python benchmarks/device_check.py --out runs/dry --dry-run    # the same on this CPU, tiny

Sections, in this order, each in its own process (a crash, a hung compile or a poisoned CUDA
context ends that section only; the next one starts fresh):

  device          versions, device kind, the chip table's figures (benchmarks/_gpu_chips.py),
                  HBM bandwidth measured with a device copy, the bf16 matmul peak
  kda_check       the GPU KDA backends (Mosaic GPU on sm_90+, Triton) against the chunked
                  reference in float64 on the same values at K = V = 128: forward (o, final
                  state), gradient (all six inputs) and decode steps, float32 and bf16 q/k/v,
                  within tests/numerics.py's derived tolerances (the CPU tests')
  kda_speed       forward and forward+backward at T = 8,192, H = 96 (the K3 layer): the GPU
                  backends and the XLA chunked path
  kda_fla         fla's Triton `chunk_kda` at the same shape (torch only)
  grouped_matmul  bf16 (ragged_dot, tiled) and packed MXFP4 against a dense matmul of the same
                  FLOPs
  train           a few steps of the ~100M K3-shaped model (benchmarks/train.py's k3_100m) in
                  bf16: MFU against the chip's bf16 dense peak and against the measured one
  decode          the engine's decode step at batch 1 and 8 against the time to read the active
                  weights once at the measured HBM bandwidth

After each section, OUT/device_check.json (everything so far; `sections.<name>.status` is ok,
partial (a part failed: its `error` says why, the rest ran), failed, timeout or skipped) and
OUT/device_check.log (every section's output) are rewritten; at the end a table is printed.
The run stops itself at --budget-s: the time left is shared among the sections not yet run in
proportion to their SHARE, and a section past its share is stopped with what it saved.

--dry-run: the same sections on the CPU (JAX_PLATFORMS=cpu) at tiny sizes, the Pallas kernels
in interpret mode, fla skipped; tests/test_device_check.py runs it. The GPU route (which JAX,
which wheels travel) is docs/benchmarks.md's "A window on one GPU".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HERE = os.path.abspath(__file__)

# name: ("module:function" under benchmarks, share of the budget, runs on a GPU only). The
# shares follow what each section compiles: Triton's KDA backward alone took minutes to compile
# ahead of time on the CPU, so it comes last inside kda_check and kda_speed, where a section
# stopped at its share loses only it.
SECTIONS = {
    "device": ("_device_ops:device", 1, False),
    "kda_check": ("_device_kda:kda_check", 3, False),
    "kda_speed": ("_device_kda:kda_speed", 3, False),
    "kda_fla": ("_device_kda:kda_fla", 2, True),
    "grouped_matmul": ("_device_ops:grouped_matmul", 1, False),
    "train": ("_device_model:train", 3, False),
    "decode": ("_device_model:decode", 2, False),
}
MIN_SECTION_S = 5.0  # a section given less than this is skipped
RESERVE_S = 3.0      # kept back from the budget for the last write and the table
TAIL_LINES = 30      # of a failed or stopped section's output, kept in the JSON


@dataclasses.dataclass(frozen=True)
class Sizes:
  """One run's sizes."""
  copy_mib: int                           # device: the buffer of the bandwidth copy
  matmul_n: int                           # the square bf16 matmul of the measured peak
  reps: int                               # timed runs (median) after the compile and a warm-up
  check: tuple[int, int, int, int]        # kda_check: B, T, H, K (= V)
  check_dtypes: tuple[str, ...]           # kda_check: q/k/v dtypes
  check_batch: int                        # kda_check's decode rows
  check_steps: int                        # and steps
  speed: tuple[int, int, int, int]        # kda_speed, kda_fla: B, T, H, K (= V)
  speed_backends: tuple[str, ...]         # kda_speed: in this order (Triton's backward compiles
                                          # longest: last)
  gmm: tuple[int, int, int, int]          # grouped_matmul: rows m, in h, out f, experts E
  train_model: str                        # _device_model.model's names
  train_shape: tuple[int, int, int]       # rows, positions, timed steps
  decode_model: str
  decode_batches: tuple[int, ...]
  decode_prompt: int
  decode_blocks: int                      # timed decode blocks of 8 steps per run


DEVICE = Sizes(
    copy_mib=2048, matmul_n=8192, reps=5,
    check=(2, 300, 4, 128), check_dtypes=("float32", "bfloat16"), check_batch=8, check_steps=4,
    speed=(1, 8192, 96, 128), speed_backends=("pallas_mosaic_gpu", "xla_cpu", "pallas_gpu"),
    gmm=(32768, 3584, 3072, 32),
    train_model="k3_100m", train_shape=(16, 2048, 3),
    decode_model="k3_100m", decode_batches=(1, 8), decode_prompt=64, decode_blocks=6)
DRY = Sizes(
    copy_mib=8, matmul_n=128, reps=1,
    check=(1, 64, 1, 64), check_dtypes=("float32",), check_batch=1, check_steps=2,
    speed=(1, 64, 1, 64), speed_backends=("xla_cpu",),
    gmm=(256, 64, 64, 4),
    train_model="micro", train_shape=(2, 32, 1),
    decode_model="micro", decode_batches=(2,), decode_prompt=8, decode_blocks=1)


class Record:
  """A section's results as nested dicts, written to OUT/sections/<name>.json after every
  change, so a section stopped midway leaves what it measured."""

  def __init__(self, out: str, name: str):
    self.out, self.path, self.data = out, section_path(out, name), {}

  def put(self, keys: str, value) -> None:
    """Set the value at "a/b/c" and save."""
    *parents, last = keys.split("/")
    node = self.data
    for k in parents:
      node = node.setdefault(k, {})
    node[last] = value
    write_json(self.path, self.data)

  @contextlib.contextmanager
  def part(self, keys: str):
    """One measurement: an exception inside is saved as keys/error and the section goes on.
    Prints a line either way (the log's progress)."""
    t0 = time.perf_counter()
    try:
      yield
    except Exception as e:  # noqa: BLE001 - one failing part must not end the section
      traceback.print_exc()
      self.put(f"{keys}/error", one_line(e))
      print(f"{keys}: FAILED after {time.perf_counter() - t0:.1f} s: {one_line(e)}", flush=True)
    else:
      print(f"{keys}: done in {time.perf_counter() - t0:.1f} s", flush=True)

  def sibling(self, name: str) -> dict:
    """An earlier section's saved results ({} if it saved none)."""
    return read_json(section_path(self.out, name))


def one_line(e: BaseException) -> str:
  first = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {first[:400]}"


def section_path(out: str, name: str) -> str:
  return os.path.join(out, "sections", f"{name}.json")


def write_json(path: str, data) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, default=float)
  os.replace(tmp, path)


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}


# ---- the parent: one child process per section ------------------------------------------------

def errors(tree, path=""):
  """(where, error) of every part that failed in a section's results."""
  if isinstance(tree, dict):
    for k, v in tree.items():
      if k == "error":
        yield path, v
      else:
        yield from errors(v, f"{path}/{k}" if path else k)


def run_child(name: str, a, timeout: float, log) -> tuple[int | None, float, float, list[str]]:
  """(exit code or None on timeout, wall seconds, CPU seconds, its last lines of output): the
  section in a child process, its output copied to the log and to stdout line by line."""
  cmd = [sys.executable, "-u", HERE, "--section", name, "--out", a.out] + (
      ["--dry-run"] if a.dry_run else [])
  env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if a.dry_run else {}))
  t0, cpu0 = time.perf_counter(), _children_cpu()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, start_new_session=True)

  tail = collections.deque(maxlen=TAIL_LINES)

  def pump():
    for line in proc.stdout:
      tail.append(line.rstrip())
      log.write(f"[{name}] {line}")
      log.flush()
      print(f"[{name}] {line}", end="", flush=True)

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  try:
    code = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    code = None
  finally:  # past its share, or this process told to stop: the child and what it started
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  reader.join(timeout=5)
  return code, time.perf_counter() - t0, _children_cpu() - cpu0, list(tail)


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def run_sections(a, names: list[str], report: dict, log) -> None:
  start = time.perf_counter()
  for i, name in enumerate(names):
    _, share, gpu_only = SECTIONS[name]
    left = a.budget_s - RESERVE_S - (time.perf_counter() - start)
    allotted = left * share / sum(SECTIONS[n][1] for n in names[i:])
    entry = {"allotted_s": allotted}
    if gpu_only and a.dry_run:
      entry.update(status="skipped", why="needs a CUDA GPU (fla's Triton kernels)")
    elif allotted < MIN_SECTION_S:
      entry.update(status="skipped", why=f"budget: {max(left, 0):.0f} s left of --budget-s")
    else:
      code, seconds, cpu_s, tail = run_child(name, a, allotted, log)
      data = read_json(section_path(a.out, name))
      failed = dict(errors(data))
      status = ("timeout" if code is None else "failed" if code else "skipped"
                if "skipped" in data else "partial" if failed else "ok")
      entry.update(status=status, seconds=seconds, cpu_s=cpu_s, exit_code=code, **data)
      if failed:
        entry["failed_parts"] = failed
      if status in ("failed", "timeout"):
        entry["output_tail"] = tail
    report["sections"][name] = entry
    report["elapsed_s"] = time.perf_counter() - start
    write_json(os.path.join(a.out, "device_check.json"), report)
    line = f"== {name}: {entry['status']}" + (f" in {entry['seconds']:.0f} s" if "seconds" in
                                              entry else f" ({entry.get('why', '')})")
    log.write(line + "\n")
    log.flush()
    print(line, flush=True)


# ---- the table ---------------------------------------------------------------------------------

def _fmt(x, scale=1.0, unit="", digits=3):
  return "-" if x is None else f"{x * scale:.{digits}g}{unit}"


def _get(tree, keys: str):
  for k in keys.split("/"):
    if not isinstance(tree, dict) or k not in tree:
      return None
    tree = tree[k]
  return tree


def _dicts(tree) -> list[tuple[str, dict]]:
  """The (key, value) pairs of `tree` whose values are dicts (none if it is not a dict)."""
  return [(k, v) for k, v in tree.items() if isinstance(v, dict)] if isinstance(tree, dict) else []


def table_rows(s: dict) -> list[tuple[str, str, str]]:
  """(section, figure, value) rows of the headline figures found in the report's sections."""
  rows = []
  for name, e in s.items():
    rows.append((name, "status", f"{e['status']}" + (f" ({e['why']})" if "why" in e else "")))
  dev = s.get("device", {})
  chip = dev.get("chip") or {}
  rows += [("device", "device", f"{dev.get('device_kind')} ({dev.get('platform')})"),
           ("device", "HBM bandwidth (table)", f"{_fmt(dev.get('hbm_bandwidth'), 1e-9)} GB/s "
            f"({_fmt(chip.get('hbm_bandwidth'), 1e-9)})"),
           ("device", "bf16 matmul peak (table)", f"{_fmt(dev.get('matmul_peak'), 1e-12)} "
            f"TFLOP/s ({_fmt(chip.get('peak_bf16_flops'), 1e-12)})")]
  for backend, r in _dicts(_get(s, "kda_check/results")):
    for dtype, checks in _dicts(r):
      if dtype != "skipped":
        worst = max((v["max_err_over_tol"] for c in checks.values() if isinstance(c, dict)
                     for v in c.values() if isinstance(v, dict) and "max_err_over_tol" in v),
                    default=None)
        bad = [w for w, c in checks.items() if isinstance(c, dict) and "error" in c]
        rows.append(("kda_check", f"{backend} {dtype}", f"worst err/tol {_fmt(worst)}"
                     + (f"; failed: {', '.join(bad)}" if bad else "")))
  speed = dict(_dicts(_get(s, "kda_speed/results")), **dict(_dicts(_get(s, "kda_fla/results"))))
  fla = speed.get("fla_chunk_kda", {})
  for backend, r in speed.items():
    cells = []
    for mode in ("fwd", "fwd_bwd"):
      sec, ref = _get(r, f"{mode}/seconds"), _get(fla, f"{mode}/seconds")
      cells.append(f"{mode} {_fmt(sec, 1e3)} ms" + (f" ({ref / sec:.2f}x fla)" if sec and ref
                                                    else ""))
    rows.append(("kda_speed", backend, ", ".join(cells)))
  for impl, r in _dicts(_get(s, "grouped_matmul/results")):
    rows.append(("grouped_matmul", impl, ", ".join(
        f"{m} {_fmt(_get(r, f'{m}/seconds'), 1e3)} ms ({_fmt(_get(r, f'{m}/over_dense'))}x "
        "dense)" for m in ("fwd", "fwd_bwd") if m in r)))
  tr = _get(s, "train/results") or {}
  if tr:
    rows.append(("train", "step, tokens/s", f"{_fmt(tr.get('step_s'), 1e3)} ms, "
                 f"{_fmt(tr.get('tokens_per_s'))}"))
    chip_mfu, mfu = _fmt(tr.get("mfu_vs_chip_peak"), 100), _fmt(tr.get("mfu"), 100)
    rows.append(("train", "MFU vs chip (vs measured peak)", f"{chip_mfu}% ({mfu}%)"))
  for batch, r in _dicts(_get(s, "decode/results")):
    rows.append(("decode", f"batch {batch}", f"step {_fmt(r.get('step_s'), 1e3)} ms, weights "
                 f"bound {_fmt(r.get('weights_bound_s'), 1e3)} ms, {_fmt(r.get('over_bound'))}x"))
  return rows


def print_table(report: dict) -> None:
  rows = table_rows(report["sections"])
  w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
  for sec, what, value in rows:
    print(f"{sec:<{w0}}  {what:<{w1}}  {value}")


# ---- entry points ------------------------------------------------------------------------------

def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="runs/device_check",
                 help="folder for device_check.json, device_check.log and sections/")
  p.add_argument("--budget-s", type=float, default=300.0,
                 help="stop after this many seconds in all (default 300)")
  p.add_argument("--sections", default=",".join(SECTIONS),
                 help=f"comma list, in this order: {','.join(SECTIONS)}")
  p.add_argument("--dry-run", action="store_true",
                 help="on the CPU: tiny sizes, Pallas kernels in interpret mode, fla skipped")
  p.add_argument("--section", help=argparse.SUPPRESS)  # a child: run this one section
  a = p.parse_args(argv)
  names = a.sections.split(",")
  unknown = [n for n in names if n not in SECTIONS]
  if unknown:
    p.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
  return a, [n for n in SECTIONS if n in names]


def child(a) -> int:
  """Run one section in this process; its results go to OUT/sections/<name>.json."""
  module, function = SECTIONS[a.section][0].split(":")
  fn = getattr(importlib.import_module(f"benchmarks.{module}"), function)
  rec = Record(a.out, a.section)
  rec.put("started", datetime.datetime.now().isoformat(timespec="seconds"))
  fn(rec, DRY if a.dry_run else DEVICE, a.dry_run)
  return 0


def main(argv=None) -> int:
  a, names = parse_args(argv)
  os.makedirs(os.path.join(a.out, "sections"), exist_ok=True)
  if a.section:
    return child(a)
  for name in names:  # nothing stale from an earlier run in this folder
    with contextlib.suppress(FileNotFoundError):
      os.remove(section_path(a.out, name))
  report = {"command": " ".join(sys.argv if argv is None else [HERE, *argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "dry_run": a.dry_run, "budget_s": a.budget_s,
            "sizes": dataclasses.asdict(DRY if a.dry_run else DEVICE), "sections": {}}
  with open(os.path.join(a.out, "device_check.log"), "w") as log:
    run_sections(a, names, report, log)
  print_table(report)
  return 0


if __name__ == "__main__":
  # a SIGTERM (the window's own time limit) raises SystemExit here, and run_child's `finally`
  # ends the running section's process group with it
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  sys.exit(main())
