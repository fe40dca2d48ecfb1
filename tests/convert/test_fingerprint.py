"""The base fingerprint (convert/fingerprint.py) is cheap and says what changed: on the
released layout it reads each shard's header and its sampled ranges, nothing more (bytes
counted by wrapping the module's file reads), and its hashes are those of the bytes the
documented ranges name; on an Orbax folder a changed byte in a sampled range of a large data
file, or any change to a small metadata file, is reported by file."""

import builtins
import hashlib
import os
import shutil
import struct

import numpy as np
import orbax.checkpoint as ocp

from convert import fingerprint

SAMPLED = fingerprint.SAMPLES * fingerprint.SAMPLE_BYTES


class _Counting:
  def __init__(self, f, counts, path):
    self._f, self._counts, self._path = f, counts, path

  def read(self, n=-1):
    data = self._f.read(n)
    self._counts[self._path] = self._counts.get(self._path, 0) + len(data)
    return data

  def __getattr__(self, name):
    return getattr(self._f, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()


def counting_fingerprint(folder, monkeypatch):
  counts = {}
  monkeypatch.setattr(fingerprint, "open",
                      lambda path, mode="r": _Counting(builtins.open(path, mode), counts,
                                                       os.path.relpath(path, folder)),
                      raising=False)
  fp = fingerprint.fingerprint(folder)
  monkeypatch.undo()
  return fp, counts


def test_safetensors_folder_reads_headers_and_samples_only(reference_dir, monkeypatch):
  folder = os.path.join(reference_dir, "k3_tiny_a")
  fp, counts = counting_fingerprint(folder, monkeypatch)
  shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
  assert sorted(fp) == sorted(shards + ["config.json", "model.safetensors.index.json"])
  for name in shards:
    path = os.path.join(folder, name)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    # exactly the header and 16 ranges of 4 KiB: about a quarter of these small shards, a
    # vanishing share of a K3 shard (gigabytes)
    assert counts[name] == 8 + n + SAMPLED < size / 3
    # the documented ranges: 16 of 4 KiB over the data section, first at its start, last at
    # the end of the file, evenly spaced between
    data_start, step = 8 + n, (size - 8 - n - 4096) / 15
    starts = [data_start + int(i * step) for i in range(16)]
    assert starts[-1] + 4096 == size
    sampled = hashlib.sha256(b"".join(raw[s:s + 4096] for s in starts)).hexdigest()
    assert fp[name] == {"size": size, "header": hashlib.sha256(raw[:8 + n]).hexdigest(),
                        "samples": sampled}
  for name in ("config.json", "model.safetensors.index.json"):  # small: whole
    with open(os.path.join(folder, name), "rb") as f:
      assert fp[name]["sha256"] == hashlib.sha256(f.read()).hexdigest()
  assert fingerprint.total_bytes(fp) == fingerprint.weight_bytes(folder) == sum(
      os.path.getsize(os.path.join(folder, n)) for n in fp)
  assert fingerprint.differences(fp, fingerprint.fingerprint(folder)) == []


def test_orbax_folder_changes_are_named(tmp_path, monkeypatch):
  folder = str(tmp_path / "model")
  rng = np.random.default_rng(0)
  checkpointer = ocp.StandardCheckpointer()
  # random float32 does not compress: a data file of about 1 MB
  checkpointer.save(folder, {"w": rng.standard_normal((512, 512), np.float32),
                             "b": np.zeros(3, np.float32)})
  checkpointer.wait_until_finished()
  os.makedirs(os.path.join(folder, "hf"))
  with open(os.path.join(folder, "hf", "tokenizer_config.json"), "w") as f:
    f.write("{}")
  fp, counts = counting_fingerprint(folder, monkeypatch)
  assert not any(rel.startswith("hf") for rel in fp)  # side files are not the weights
  big = max(fp, key=lambda rel: fp[rel]["size"])
  size = fp[big]["size"]
  assert size > 900_000 and counts[big] == SAMPLED and "samples" in fp[big]
  small = [rel for rel in fp if fp[rel]["size"] <= fingerprint.WHOLE_BYTES]
  assert "_METADATA" in small and all(counts[rel] == fp[rel]["size"] for rel in small)

  copy = str(tmp_path / "copy")
  shutil.copytree(folder, copy)
  ranges = fingerprint.sampled_ranges(0, size)
  with open(os.path.join(copy, big), "r+b") as f:
    f.seek(ranges[7][0] + 100)
    byte = f.read(1)
    f.seek(ranges[7][0] + 100)
    f.write(bytes([byte[0] ^ 0xFF]))
  with open(os.path.join(copy, "_METADATA"), "a") as f:
    f.write(" ")
  os.remove(os.path.join(copy, "_CHECKPOINT_METADATA"))
  assert fingerprint.differences(fp, fingerprint.fingerprint(copy)) == [
      "_CHECKPOINT_METADATA is missing",
      f"_METADATA: size differs ({fp['_METADATA']['size']} bytes, now "
      f"{fp['_METADATA']['size'] + 1})", f"{big}: sampled bytes differ"]
