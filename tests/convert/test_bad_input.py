"""Broken copies of the tiny checkpoint: each is refused with one line naming the file, tensor
or field, exit code 2, no traceback, and nothing left behind in the output's folder.

No traceback anywhere: neither on stderr nor in a log record (Orbax logs an exception raised
in its save threads, with its traceback, on the user's terminal; pytest would catch those
records out of sight of `capsys`)."""

import json
import os
import shutil
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from k3jax.cli import main

SHARD1 = "model-00001-of-00003.safetensors"
SHARD3 = "model-00003-of-00003.safetensors"
INDEX = "model.safetensors.index.json"
A_LOG = "language_model.model.layers.0.self_attn.A_log"


@pytest.fixture(autouse=True)
def no_logged_traceback(caplog):
  yield
  traced = [r.getMessage() for r in caplog.get_records("call") if r.exc_info]
  assert not traced, f"logged with a traceback: {traced[0]}"


@pytest.fixture
def hf(reference_dir, tmp_path):
  src = os.path.join(reference_dir, "k3_tiny_a")
  dst = tmp_path / "hf"
  dst.mkdir()
  for f in os.listdir(src):
    if not f.endswith(".npz"):
      shutil.copy(os.path.join(src, f), dst / f)
      os.chmod(dst / f, 0o644)
  return dst


def edit_shard(folder, file, fn):
  """Rewrite one shard through safetensors with fn(tensors) applied; keep the index in step."""
  path = os.path.join(folder, file)
  with safe_open(path, "numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  tensors = fn(tensors)
  save_file(tensors, path, metadata={"format": "pt"})
  with open(os.path.join(folder, INDEX)) as f:
    index = json.load(f)
  index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
  index["weight_map"].update(dict.fromkeys(tensors, file))
  with open(os.path.join(folder, INDEX), "w") as f:
    json.dump(index, f)


def edit_json(path, fn):
  with open(path) as f:
    data = json.load(f)
  fn(data)
  with open(path, "w") as f:
    json.dump(data, f)


def run_convert(hf, tmp_path, capsys, *extra):
  out = tmp_path / "out"
  rc = main(["convert", str(hf), str(out), "--quiet", *extra])
  err = capsys.readouterr().err.strip()
  return rc, err, out


def assert_refused(hf, tmp_path, capsys, *needles):
  rc, err, out = run_convert(hf, tmp_path, capsys)
  assert rc == 2, err
  assert "\n" not in err and "Traceback" not in err, err
  for needle in needles:
    assert needle in err, err
  assert not out.exists()
  assert sorted(os.listdir(tmp_path)) == ["hf"], "temporary output left behind"


def test_truncated_shard(hf, tmp_path, capsys):
  path = hf / SHARD3
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  assert_refused(hf, tmp_path, capsys, SHARD3, "truncated")


def test_malformed_header(hf, tmp_path, capsys):
  path = hf / SHARD1
  data = bytearray(path.read_bytes())
  data[8:20] = b"{garbage!!!}"
  path.write_bytes(bytes(data))
  assert_refused(hf, tmp_path, capsys, SHARD1, "malformed header")


@pytest.mark.parametrize("delta,needle", [(-1, "wrong header length"), (+1, "header")])
def test_header_length_off_by_one(hf, tmp_path, capsys, delta, needle):
  """The header JSON still parses (its padding absorbs the byte), but the data section then
  starts a byte early (or late) and no longer matches the tensors exactly."""
  path = hf / SHARD1
  data = path.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  assert data[8 + n - 1:8 + n] == b" "  # padding, so the JSON survives either way
  path.write_bytes(struct.pack("<Q", n + delta) + data[8:])
  assert_refused(hf, tmp_path, capsys, SHARD1, needle)


def test_bytes_appended_to_a_shard(hf, tmp_path, capsys):
  path = hf / SHARD3
  path.write_bytes(path.read_bytes() + b"\0")
  assert_refused(hf, tmp_path, capsys, SHARD3, "appended")


def test_oversized_header(hf, tmp_path, capsys):
  path = hf / SHARD1
  data = path.read_bytes()
  path.write_bytes(struct.pack("<Q", 2**62) + data[8:])
  assert_refused(hf, tmp_path, capsys, SHARD1, "exceeds")


@pytest.mark.parametrize("target", ["../model-00001-of-00003.safetensors", "/etc/passwd",
                                    "sub/../../x.safetensors"])
def test_index_points_outside_the_folder(hf, tmp_path, capsys, target):
  edit_json(hf / INDEX, lambda d: d["weight_map"].__setitem__(A_LOG, target))
  assert_refused(hf, tmp_path, capsys, INDEX, repr(target), "outside the checkpoint folder")


def test_missing_shard_file(hf, tmp_path, capsys):
  os.remove(hf / SHARD3)
  assert_refused(hf, tmp_path, capsys, SHARD3, "missing")


def test_unknown_config_field(hf, tmp_path, capsys):
  edit_json(hf / "config.json", lambda d: d["text_config"].__setitem__("mystery_knob", 3))
  assert_refused(hf, tmp_path, capsys, "mystery_knob")


def test_missing_tensor(hf, tmp_path, capsys):
  name = "language_model.model.layers.1.self_attn.q_proj.weight"
  edit_shard(hf, SHARD1, lambda t: {k: v for k, v in t.items() if k != name})
  assert_refused(hf, tmp_path, capsys, name, "missing")


def test_extra_tensor(hf, tmp_path, capsys):
  name = "language_model.model.layers.1.self_attn.secret_proj.weight"
  edit_shard(hf, SHARD1, lambda t: {**t, name: np.zeros((4, 4), np.float32)})
  assert_refused(hf, tmp_path, capsys, name, "unexpected", SHARD1)


def test_wrong_shape(hf, tmp_path, capsys):
  name = "language_model.model.layers.1.self_attn.b_proj.weight"
  edit_shard(hf, SHARD1, lambda t: {**t, name: t[name].T.copy()})
  assert_refused(hf, tmp_path, capsys, name, "shape", SHARD1)


def test_wrong_dtype(hf, tmp_path, capsys):
  name = "language_model.model.layers.1.self_attn.q_conv1d.weight"  # an F32 exception
  edit_shard(hf, SHARD1, lambda t: {**t, name: t[name].astype(ml_dtypes.bfloat16)})
  assert_refused(hf, tmp_path, capsys, name, "BF16", "F32")


def poke_a_log_padding(t):
  a = t[A_LOG].copy()
  a[-1] = 0.5
  return {**t, A_LOG: a}


def test_nonzero_a_log_padding(hf, tmp_path, capsys):
  edit_shard(hf, SHARD1, poke_a_log_padding)
  assert_refused(hf, tmp_path, capsys, A_LOG, "padding")


def test_nonzero_a_log_padding_as_a_user_sees_it(hf, tmp_path):
  """The same refusal from the command line itself: the A_log check runs in Orbax's save
  thread, whose failures Orbax logs with a traceback; stderr must hold the one line only."""
  edit_shard(hf, SHARD1, poke_a_log_padding)
  proc = subprocess.run([sys.executable, "-m", "k3jax.cli", "convert", "hf", "out", "--quiet"],
                        check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert lines[0].startswith(f"k3jax convert: error: tensor {A_LOG}: A_log padding"), lines
  assert sorted(os.listdir(tmp_path)) == ["hf"], "temporary output left behind"


def test_existing_output_needs_force(hf, tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  rc, err, _ = run_convert(hf, tmp_path, capsys, "--layers", "0-0")
  assert rc == 2 and "--force" in err and (out / "keep.txt").exists()
  rc, err, _ = run_convert(hf, tmp_path, capsys, "--layers", "0-0", "--force")
  assert rc == 0, err
  assert not (out / "keep.txt").exists() and (out / "_METADATA").exists()
  assert sorted(os.listdir(tmp_path)) == ["hf", "out"]


def test_export_of_a_non_checkpoint(hf, tmp_path, capsys):
  rc = main(["export", str(hf), str(tmp_path / "x"), "--quiet"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and "k3jax_config.json" in err and "\n" not in err
