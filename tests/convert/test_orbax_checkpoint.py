"""The converted checkpoint as Orbax sees it: Orbax's own metadata, one OCDBT database, a
sharded restore onto 8 devices, and `--resume` after an interruption (Ctrl-C, SIGKILL).

Truth is the one-device load of the same folder (`load_model`, which never touches Orbax) and
an uninterrupted conversion; values are compared exactly (the checkpoint stores the source
values, and a restore only copies them).
"""

import _thread
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import warnings

import jax
import ml_dtypes  # noqa: F401
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import configs
from convert import orbax_io, to_orbax
from convert.hf_load import load_model
from convert.load import load_checkpoint, named_shardings
from convert.outdir import partial_dir
from convert.variables import abstract_variables
from k3jax.cli import main
from sharding.rules import MESH_AXES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_BATCH = 64 << 10  # bytes per write batch in the resume tests: the tiny model in ~15


@pytest.fixture(scope="module")
def hf_dir(reference_dir):
  return os.path.join(reference_dir, "k3_tiny_a")


@pytest.fixture(scope="module")
def ckpt(hf_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("orbax") / "ckpt")
  assert main(["convert", hf_dir, out, "--quiet"]) == 0
  return out


def _flat(model):
  return {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def direct(hf_dir):
  return {k: np.asarray(v) for k, v in _flat(load_model(hf_dir)[0]).items()}


def test_orbax_reads_its_own_metadata(ckpt, direct, caplog):
  """`StandardCheckpointer().metadata()` without a warning; every variable at its shape;
  one OCDBT database instead of a file per array (or per expert matrix)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with caplog.at_level(logging.WARNING):
      meta = ocp.StandardCheckpointer().metadata(ckpt)
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
  assert meta.item_handlers.endswith("StandardCheckpointHandler")
  assert meta.init_timestamp_nsecs <= meta.commit_timestamp_nsecs
  tree = meta.item_metadata.tree
  for path, value in direct.items():
    node = tree
    for k in path:
      node = node[k]
    leaf = node["value"]
    assert tuple(leaf.shape) == value.shape, path
  assert ocp.type_handlers.is_ocdbt_checkpoint(ckpt)
  files = [f for _, _, fs in os.walk(ckpt) for f in fs]
  n_arrays = len(direct)
  n_expert_matrices = 3 * int(np.prod(direct["moe", "experts", "w1"].shape[:2]))
  assert len(files) < n_arrays < n_expert_matrices, (len(files), n_arrays)


@pytest.fixture(scope="module")
def ckpt_mxfp4(hf_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("ref") / "ckpt")
  assert main(["convert", hf_dir, out, "--experts", "mxfp4", "--quiet"]) == 0
  return out


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_sharded_restore_on_8_devices(ckpt, ckpt_mxfp4, direct, experts):
  """NamedSharding targets from the rules table on a (data 1, fsdp 2, expert 2, tensor 2)
  mesh: every array arrives with its sharding, and every device's shard is the one-device
  value at that shard's index. The expert stacks are split 8 ways (experts over expert x fsdp,
  moe_mlp over tensor), so each device holds (and Orbax reads) an eighth of them; kept MXFP4
  codes are restored sharded the same way and dequantised where they lie."""
  assert jax.device_count() == 8
  path = ckpt if experts == "bf16" else ckpt_mxfp4
  mesh = jax.make_mesh((1, 2, 2, 1, 2), MESH_AXES)
  cfg = configs.resolve(path)
  shardings = named_shardings(cfg, mesh)
  model, _ = load_checkpoint(path, shardings=shardings)
  got = _flat(model)
  split = {}
  for path, want in direct.items():
    array = got[path]
    assert array.sharding.is_equivalent_to(shardings[path], array.ndim), path
    shards = array.addressable_shards
    assert len(shards) == 8
    for shard in shards:
      assert shard.data.shape == shardings[path].shard_shape(want.shape), path
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index],
                                    err_msg=f"{'.'.join(path)} on device {shard.device.id}")
    split[path] = len({tuple((s.start, s.stop) for s in sh.index) for sh in shards})
  w1 = ("moe", "experts", "w1")
  assert split[w1] == 8, split[w1]
  per_device = {sh.device.id: tuple((s.start, s.stop) for s in sh.index[1:])
                for sh in got[w1].addressable_shards}
  print(f"\nmoe.experts.w1 {direct[w1].shape} ({experts}) per device (experts, latent, moe_mlp):")
  for device, index in sorted(per_device.items()):
    print(f"  device {device}: {index}")


# ---- resume ------------------------------------------------------------------------------

def _restored(path):
  """Every array of a checkpoint, through Orbax (no target: numpy, as stored)."""
  tree = ocp.StandardCheckpointer().restore(path)
  return {tuple(str(getattr(k, "key", k)) for k in keys): np.asarray(v)
          for keys, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_same_checkpoint(got, want):
  """The same arrays (bytes), tree metadata and k3jax files as an uninterrupted run."""
  a, b = _restored(got), _restored(want)
  assert sorted(a) == sorted(b)
  for k in b:
    assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
  for name in ("_METADATA", to_orbax.MANIFEST, to_orbax.CONFIG, "hf/config.json"):
    with open(os.path.join(got, name), "rb") as f, open(os.path.join(want, name), "rb") as g:
      assert f.read() == g.read(), name
  def top(d):  # the files beside the OCDBT database
    return sorted(f for f in os.listdir(d) if f != "d" and not f.startswith("ocdbt"))
  assert top(got) == top(want)
  assert not os.path.exists(partial_dir(got))


def _journal(out):
  with open(os.path.join(partial_dir(out), to_orbax.JOURNAL)) as f:
    return f.read().splitlines()


@pytest.fixture
def default_sigint():
  """Python's own SIGINT handler for the test: a pytest-xdist worker can run with SIGINT
  ignored, and then `_thread.interrupt_main()` (a simulated Ctrl-C) does nothing."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def test_ctrl_c_then_resume(hf_dir, ckpt_mxfp4, tmp_path, monkeypatch, capsys, default_sigint):
  """Ctrl-C mid-way keeps the committed batches; a rerun without --resume is refused (the
  work is not thrown away), with other options too; --resume finishes it."""
  monkeypatch.setattr(orbax_io, "TXN_BYTES", SMALL_BATCH)
  stream_items = to_orbax._items
  streams = []

  class Recorded(orbax_io.Stream):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      streams.append(self)

  def interrupted(source, items, *args):
    for n, item in enumerate(stream_items(source, items, *args)):
      if n == len(items) // 2:
        _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread
        # the main thread asks the stream to stop: wait for it, however loaded the machine
        assert streams[-1].stop.wait(120), "the interrupt never asked the stream to stop"
      yield item

  monkeypatch.setattr(orbax_io, "Stream", Recorded)

  monkeypatch.setattr(to_orbax, "_items", interrupted)
  out = str(tmp_path / "ckpt")
  assert main(["convert", hf_dir, out, "--experts", "mxfp4", "--quiet"]) == 130
  err = capsys.readouterr().err
  assert "interrupted" in err and "--resume" in err, err
  assert not os.path.exists(out)
  done = _journal(out)
  assert 0 < len(done), "some batches were committed before the interrupt"

  monkeypatch.setattr(to_orbax, "_items", stream_items)
  for extra, needle in (([], "--resume"), (["--resume", "--experts", "bf16"], "other inputs")):
    rc = main(["convert", hf_dir, out, "--quiet", *extra] + ([] if extra else
                                                              ["--experts", "mxfp4"]))
    msg = capsys.readouterr().err.strip()
    assert rc == 2 and needle in msg and "\n" not in msg, msg
    assert _journal(out) == done, "a refused run must not touch the kept work"

  assert main(["convert", hf_dir, out, "--experts", "mxfp4", "--quiet", "--resume"]) == 0
  assert f"{len(done)} tensors were already written" in capsys.readouterr().out
  _assert_same_checkpoint(out, ckpt_mxfp4)


KILL_AFTER = """
import os, signal, sys
from convert import orbax_io, to_orbax
from k3jax.cli import main
orbax_io.TXN_BYTES = {batch}
stream_items = to_orbax._items
def killed(source, items, *args):
  for n, item in enumerate(stream_items(source, items, *args)):
    if n == {kill_at}:
      os.kill(os.getpid(), signal.SIGKILL)
    yield item
to_orbax._items = killed
sys.exit(main(["convert", {hf!r}, {out!r}, "--experts", "mxfp4", "--quiet"]))
"""


def test_sigkill_then_resume(hf_dir, ckpt_mxfp4, tmp_path):
  """A conversion killed outright (no clean-up runs) resumes to the same checkpoint."""
  out = str(tmp_path / "ckpt")
  code = KILL_AFTER.format(batch=SMALL_BATCH, kill_at=300, hf=hf_dir, out=out)
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert proc.returncode == -9, proc.stderr
  assert not os.path.exists(out) and os.path.isdir(partial_dir(out))
  assert 0 < len(_journal(out)) < 300
  assert main(["convert", hf_dir, out, "--experts", "mxfp4", "--quiet", "--resume"]) == 0
  _assert_same_checkpoint(out, ckpt_mxfp4)


def test_force_starts_over(hf_dir, tmp_path, capsys):
  out = str(tmp_path / "ckpt")
  os.makedirs(partial_dir(out))
  with open(os.path.join(partial_dir(out), "stale"), "w") as f:
    f.write("x")
  assert main(["convert", hf_dir, out, "--layers", "0-0", "--quiet", "--force"]) == 0
  assert not os.path.exists(partial_dir(out)) and not os.path.exists(os.path.join(out, "stale"))
  with open(os.path.join(out, to_orbax.MANIFEST)) as f:
    assert json.load(f)["layers"] == [0, 0]


RESTORE_ONE_PROCESS = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("localhost:{port}", num_processes=2, process_id={pid})
import numpy as np, tensorstore as ts
import configs
from convert import orbax_io
from convert.load import named_shardings
from convert.variables import abstract_variables
from sharding.rules import MESH_AXES
mesh = jax.make_mesh((1, 1, 2, 1, 4), MESH_AXES)  # expert axis across the two processes
cfg = configs.resolve({ckpt!r})
shardings = named_shardings(cfg, mesh)
experts = {{p: orbax_io.shape_dtype(v.shape, v.get_value().dtype, shardings[p])
           for p, v in abstract_variables(cfg).items() if p[:2] == ("moe", "experts")}}
def bytes_read():
  return sum(v["value"] for m in ts.experimental_collect_matching_metrics(
      "/tensorstore/kvstore/file/bytes_read") for v in m["values"])
before = bytes_read()
got = orbax_io.restore({ckpt!r}, experts)
read = bytes_read() - before
w1 = got["moe", "experts", "w1"]
blocks = sorted({{(s.index[1].start, s.index[1].stop) for s in w1.addressable_shards}})
with open({result!r}, "w") as f:  # a file: gloo writes to this process's stdout too
  json.dump({{"read": read, "experts": blocks}}, f)
"""


def test_each_process_reads_only_its_shards(ckpt, tmp_path):
  """Two processes x 4 CPU devices (gloo), the expert axis across them: each process reads
  its half of the expert stacks from disk (TensorStore's byte count), not the whole."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  result = [str(tmp_path / f"result{pid}.json") for pid in range(2)]
  procs = [subprocess.Popen([sys.executable, "-c", RESTORE_ONE_PROCESS.format(
      port=port, pid=pid, ckpt=ckpt, result=result[pid])], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for pid in range(2)]
  results = []
  for proc, path in zip(procs, result):
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    with open(path) as f:
      results.append(json.load(f))
  stacks = [v for p, v in abstract_variables(configs.resolve(ckpt)).items()
            if p[:2] == ("moe", "experts")]
  whole = sum(int(np.prod(v.shape)) * 2 for v in stacks)  # bf16 on disk
  n = stacks[0].shape[1]
  assert [r["experts"] for r in results] == [[[0, n // 2]], [[n // 2, n]]]
  print(f"\nexpert stacks {whole} bytes; read per process: {[r['read'] for r in results]}")
  for r in results:
    # At least its half; at most one pass over the stacks plus the OCDBT manifest and B-tree
    # nodes (32-124 KiB measured). Not "only its half": Orbax restores with TensorStore read
    # coalescing (experimental_read_coalescing_threshold_bytes = 1 MB, 1 ms window), which
    # merges reads whose byte gap is under 1 MB, and this tiny model's whole expert stack is
    # 768 KiB, so whether the other half's chunks ride along depends on timing (measured
    # 425 KiB to 803 KiB per process). At K3 scale (4 MiB chunks) the gaps exceed it.
    assert whole // 2 <= r["read"] <= whole + 128 * 1024, (r["read"], whole)
