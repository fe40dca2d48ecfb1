"""`k3jax convert` as two processes (gloo, localhost): each reads about half of the source
bytes (its ShardReader's count, printed per process) and writes them into its own OCDBT
database of the one checkpoint; process 0 merges. The checkpoint restores to exactly the
arrays, and holds exactly the files, of a one-process conversion, with bf16 and with MXFP4
experts. An interrupted process stops the other with its error, and both continue from their
own journals with --resume.

The truth is the one-process conversion of the same folder (tests/convert/
test_orbax_checkpoint.py checks that one against the in-memory load, value for value)."""

import os
import re
import subprocess
import sys

import pytest

from convert import to_orbax
from convert.outdir import partial_dir
from convert.source import items_to_read, open_source
from k3jax.cli import main
from tests.convert.test_orbax_checkpoint import _assert_same_checkpoint
from tests.sharding.test_multiprocess import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_BATCH = 16 << 10  # bytes per write batch: a process's half in ~30 commits

# phase 1: bf16, mxfp4, then an mxfp4 conversion that process 1 interrupts (Ctrl-C) half-way
# through its share; phase 2: both resume it. Each prints `rc <code>` after each conversion.
DRIVER = """
import os, signal, sys
from convert import orbax_io, to_orbax
from k3jax.cli import main
hf, out, port, pid, phase, batch = sys.argv[1:7]
# Ctrl-C as at a terminal: a pytest-xdist worker ignores SIGINT and its children inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
pid = int(pid)
mp = ["--quiet", "--coordinator", f"localhost:{port}", "--num-processes", "2",
      "--process-id", str(pid)]
def run(*args):
  print("rc", main(["convert", hf, *args, *mp]), flush=True)
orbax_io.TXN_BYTES = int(batch)
if phase == "1":
  run(out + "/bf16")
  run(out + "/mxfp4", "--experts", "mxfp4")
  streams, stream_items = [], to_orbax._items
  class Recorded(orbax_io.Stream):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      streams.append(self)
  def interrupted(source, items, *args):
    for n, item in enumerate(stream_items(source, items, *args)):
      if pid == 1 and n == len(items) // 2:
        # Ctrl-C itself: a real SIGINT also wakes a main thread blocked in a wait, which
        # _thread.interrupt_main (a flag checked between bytecodes) does not
        os.kill(os.getpid(), signal.SIGINT)
        assert streams[-1].stop.wait(120), "the interrupt never asked the stream to stop"
      yield item
  orbax_io.Stream, to_orbax._items = Recorded, interrupted
  run(out + "/resumed", "--experts", "mxfp4")
else:
  run(out + "/resumed", "--experts", "mxfp4", "--resume")
"""


def _launch(hf, out, phase):
  """Both processes of one phase: their stdout and stderr."""
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-c", DRIVER, hf, out, str(port), str(pid), phase,
                             str(SMALL_BATCH)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for pid in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs


def _rcs(stdout):
  return [int(c) for c in re.findall(r"^rc (\d+)$", stdout, re.M)]


def _read(stdout):
  """(tensors, bytes read) each conversion of the phase printed for this process."""
  return [(int(t), int(b)) for t, b in
          re.findall(r"^process \d/2: (\d+) tensors, (\d+) bytes read$", stdout, re.M)]


@pytest.fixture(scope="module")
def hf_dir(reference_dir):
  return os.path.join(reference_dir, "k3_tiny_a")


def test_two_processes_convert_as_one(hf_dir, tmp_path, capsys):
  one = {e: str(tmp_path / f"one_{e}") for e in ("bf16", "mxfp4")}
  for experts, out in one.items():
    assert main(["convert", hf_dir, out, "--quiet", "--experts", experts]) == 0
  out = str(tmp_path / "two")
  (out0, err0), (out1, err1) = _launch(hf_dir, out, "1")
  assert _rcs(out0)[:2] == _rcs(out1)[:2] == [0, 0], (err0[-2000:], err1[-2000:])
  # the source's tensor bytes, each read by exactly one process, about half each
  items = items_to_read(open_source(hf_dir))
  total = sum(it.nbytes for it in items)
  read0, read1 = _read(out0)[:2], _read(out1)[:2]
  with capsys.disabled():
    print(f"\nsource: {len(items)} tensors, {total} bytes; (tensors, bytes) each process read "
          f"(bf16, mxfp4): {read0}, {read1}")
  for (t0, b0), (t1, b1) in zip(read0, read1):
    assert t0 + t1 == len(items) and b0 + b1 == total
    assert abs(b0 - b1) <= max(it.nbytes for it in items), (b0, b1)
  for experts in ("bf16", "mxfp4"):
    got = os.path.join(out, experts)
    _assert_same_checkpoint(got, one[experts])
    assert sorted(f for f in os.listdir(got) if f.startswith("ocdbt.")) == [
        "ocdbt.process_0", "ocdbt.process_1"]

  # Ctrl-C in process 1: it says how to continue; process 0 names it, in one line
  resumed = os.path.join(out, "resumed")
  assert _rcs(out1)[2] == 130 and "--resume" in err1.strip().splitlines()[-1]
  assert _rcs(out0)[2] == 2
  assert err0.strip().splitlines()[-1] == "k3jax convert: error: process 1: interrupted"
  journals = [os.path.join(partial_dir(resumed), to_orbax.journal_name(i, 2)) for i in range(2)]
  done = []
  for journal in journals:
    with open(journal) as f:
      done.append(f.read().splitlines())
  assert 0 < len(done[1]) < read1[1][0]  # process 1 committed part of its share
  # the split depends on the process count: one process may not resume it
  assert main(["convert", hf_dir, resumed, "--experts", "mxfp4", "--quiet", "--resume"]) == 2
  assert "other inputs or options" in capsys.readouterr().err

  (out0, err0), (out1, err1) = _launch(hf_dir, out, "2")
  assert _rcs(out0) == _rcs(out1) == [0], (err0[-2000:], err1[-2000:])
  assert f"{len(done[0])} tensors were already written" in out0
  _assert_same_checkpoint(resumed, one["mxfp4"])


def test_split_by_bytes_keeps_order_and_balance(hf_dir):
  items = items_to_read(open_source(hf_dir))
  biggest = max(it.nbytes for it in items)
  for count in (1, 2, 3, 7):
    runs = to_orbax.split_by_bytes(items, count)
    assert len(runs) == count and [it for run in runs for it in run] == items
    sizes = [sum(it.nbytes for it in run) for run in runs]
    assert max(sizes) - min(sizes) <= biggest, (count, sizes)


def test_processes_flags_go_together(hf_dir, tmp_path, capsys):
  for flags in (["--num-processes", "2"], ["--coordinator", "localhost:1", "--process-id", "0"],
                ["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"],
                ["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"]):
    assert main(["convert", hf_dir, str(tmp_path / "x"), "--quiet", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ("--coordinator" in err or "--process-id" in err), err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(partial_dir(tmp_path / "x"))
