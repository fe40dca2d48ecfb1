"""A cheap fingerprint of a model folder: enough to tell, at K3 size, that a folder still holds
the weights a run started from, without reading them (docs/checkpoints.md#fingerprints).

A LoRA run's checkpoints hold the adapters and a reference to the frozen base (its folder and
this fingerprint), not the base; a resume recomputes the fingerprint and refuses a base that
differs (k3jax/train/frozen_base.py).

What it records, per file of the folder's weights (relative path -> entry):
  official layout   config.json and `*.safetensors.index.json` (the index): size and SHA-256
                    of the whole file; every `*.safetensors`: size, SHA-256 of its header
                    (the 8-byte length and the JSON: names, dtypes, shapes, offsets) and of
                    `SAMPLES` ranges of `SAMPLE_BYTES` spread evenly over its data section
  k3jax checkpoint  every file but the `hf/` side files (Orbax metadata, OCDBT manifests and
                    data files, k3jax_config.json): size; a `.json` file or one up to
                    `WHOLE_BYTES` hashed whole, a larger one by the same sampled ranges over
                    the whole file
Other files (tokenizer, README, reference data) are not part of it. Bytes read per large
file: its header (safetensors) plus SAMPLES * SAMPLE_BYTES (64 KiB).
"""

from __future__ import annotations

import hashlib
import os
import struct

from convert.safetensors_io import MAX_HEADER_BYTES

SAMPLES = 16
SAMPLE_BYTES = 4096
WHOLE_BYTES = 1 << 16  # files this small (metadata) are hashed whole
SIDE_DIRS = ("hf",)    # a converted checkpoint's copied config and tokenizer files


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def sampled_ranges(begin: int, end: int) -> list[tuple[int, int]]:
  """The [start, stop) byte ranges hashed out of [begin, end): SAMPLES ranges of SAMPLE_BYTES,
  the first at `begin`, the last ending at `end`, the rest evenly between (the whole span
  when it is no longer than them all)."""
  span = end - begin
  if span <= SAMPLES * SAMPLE_BYTES:
    return [(begin, end)] if span > 0 else []
  last = span - SAMPLE_BYTES
  return [(begin + last * i // (SAMPLES - 1), begin + last * i // (SAMPLES - 1) + SAMPLE_BYTES)
          for i in range(SAMPLES)]


def _samples(f, ranges: list[tuple[int, int]]) -> str:
  h = hashlib.sha256()
  for start, stop in ranges:
    f.seek(start)
    h.update(f.read(stop - start))
  return h.hexdigest()


def _safetensors_entry(path: str, size: int) -> dict:
  with open(path, "rb") as f:
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    n = min(n, MAX_HEADER_BYTES, max(size - 8, 0))  # a damaged length: hash what is there
    header = head + f.read(n)
    data_start = len(header)
    return {"size": size, "header": _sha(header),
            "samples": _samples(f, sampled_ranges(data_start, size))}


def _file_entry(path: str, size: int) -> dict:
  with open(path, "rb") as f:
    if size <= WHOLE_BYTES or path.endswith(".json"):
      return {"size": size, "sha256": _sha(f.read())}
    return {"size": size, "samples": _samples(f, sampled_ranges(0, size))}


def weight_files(folder: str) -> list[str]:
  """The files the fingerprint covers (relative paths, sorted)."""
  names = sorted(os.listdir(folder))
  if "config.json" in names and any(n.endswith(".safetensors") for n in names):
    return [n for n in names if n == "config.json" or n.endswith((".safetensors",
                                                                   ".safetensors.index.json"))]
  out = []
  for root, dirs, files in os.walk(folder):
    rel = os.path.relpath(root, folder)
    if rel == ".":
      dirs[:] = [d for d in dirs if d not in SIDE_DIRS]
    out += [os.path.normpath(os.path.join(rel, name)) for name in files]
  return sorted(out)


def fingerprint(folder: str) -> dict[str, dict]:
  """relative path -> {size, and sha256 | header + samples} (see the module docstring)."""
  out = {}
  for rel in weight_files(folder):
    path = os.path.join(folder, rel)
    size = os.path.getsize(path)
    out[rel] = (_safetensors_entry(path, size) if rel.endswith(".safetensors")
                else _file_entry(path, size))
  return out


def total_bytes(fp: dict[str, dict]) -> int:
  """The bytes of the files a fingerprint covers: the base's size on disk."""
  return sum(entry["size"] for entry in fp.values())


def weight_bytes(folder: str) -> int:
  """The bytes of the files a fingerprint of `folder` would cover (nothing read)."""
  return sum(os.path.getsize(os.path.join(folder, rel)) for rel in weight_files(folder))


_WHAT = {"size": "size", "sha256": "contents", "header": "header",
         "samples": "sampled bytes"}


def differences(was: dict[str, dict], now: dict[str, dict]) -> list[str]:
  """What changed between two fingerprints, one short phrase each (empty: the same)."""
  out = [f"{rel} is missing" for rel in sorted(set(was) - set(now))]
  out += [f"{rel} is new" for rel in sorted(set(now) - set(was))]
  for rel in sorted(set(was) & set(now)):
    a, b = was[rel], now[rel]
    for key, what in _WHAT.items():
      if a.get(key) != b.get(key):
        out.append(f"{rel}: {what} differ{'s' if what in ('size', 'header') else ''}"
                   + (f" ({a['size']} bytes, now {b['size']})" if key == "size" else ""))
        break  # the first difference of a file says enough
  return out
