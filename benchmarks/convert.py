"""Conversion speed and memory on a synthetic checkpoint with the real K3 tensor shapes.

Builds an official-layout folder (d=7168, 96 KDA/MLA heads, dense layer 0 of width 33792, a
LatentMoE layer with MXFP4 experts of 3072 x 3584; random bytes, A_log padding zero) of a few
GB in a temporary folder beside --workdir, then in one run:

  raw read      the same shard files read front to back (64 MiB blocks), nothing else
  raw copy      the same files read and written to a new folder, synced: the ceiling for
                any converter that writes what it reads (on a disk that writes slower than
                it reads, 50% of raw read may be out of reach for everyone)
  convert       `k3jax convert` in a subprocess (end to end: start-up, validation, writes,
                final sync), experts dequantised to bf16 (4x the bytes out), then kept as
                MXFP4 codes (about the bytes in)

Before each timed read the files are dropped from the page cache (posix_fadvise DONTNEED), so
both read the disk. Throughput is source bytes / wall time. Peak RSS is the converter
process's VmHWM, set against the bound 2 x largest tensor + 1 GiB; "files" counts every file
of the checkpoint (the OCDBT data files are about one per committed write batch). Cleans up
after itself.

    python benchmarks/convert.py [--experts 32] [--vocab 32768] [--workdir /tmp]
                                 [--chunk-mib 4] [--no-raw] [--processes 2]

--processes N converts as N processes of one run on this machine (gloo, a localhost
coordinator): the wall time of the whole, the peak RSS of each process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from convert.name_map import DIALECTS, PACKED, SCALE, full_name, hf_shape, slots
from convert.safetensors_io import DTYPES, ShardWriter, encode_header
from convert.variables import param_shapes
from k3jax.hf_config import from_hf_config

GiB = 1 << 30
# (bits dtype, sign+mantissa mask, exponent of 0.5) per float dtype
FLOAT_BITS = {"BF16": (np.uint16, np.uint16(0x807F), np.uint16(0x3F00)),
              "F32": (np.uint32, np.uint32(0x807FFFFF), np.uint32(0x3F000000))}


def k3_config(num_experts: int, vocab: int) -> dict:
  """K3's text_config shapes, two layers: KDA + dense MLP, then MLA + LatentMoE."""
  text = {
      "model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": 7168,
      "num_hidden_layers": 2, "num_attention_heads": 96, "num_key_value_heads": 96,
      "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
      "mla_use_output_gate": True, "intermediate_size": 33792, "moe_intermediate_size": 3072,
      "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
      "num_experts": num_experts, "num_experts_per_token": min(16, num_experts),
      "num_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
      "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
      "routed_scaling_factor": 1.0, "hidden_act": "situ", "activation_situ_beta": 4.0,
      "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "rms_norm_eps": 1e-5,
      "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                             "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                             "full_attn_layers": [2], "kda_layers": [1]},
      "tie_word_embeddings": False,
  }
  return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
          "text_config": text}


def build(folder: str, num_experts: int, vocab: int) -> tuple[int, int]:
  """Write the synthetic folder; returns (source bytes, largest tensor bytes)."""
  config = k3_config(num_experts, vocab)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  cfg = from_hf_config(config)
  shapes = param_shapes(cfg)
  dialect = DIALECTS["k3"]
  shards: list[list] = [[], []]  # embedding + layer 0 | layer 1 + head
  for slot in slots(cfg):
    name, shape = full_name(slot.hf_name, dialect), hf_shape(slot.entry, cfg, shapes)
    shard = shards[0] if slot.layer == 0 or "embed" in name else shards[1]
    if slot.entry.mxfp4:
      base = name.removesuffix(".weight")
      shard.append((base + PACKED, "U8", (shape[0], shape[1] // 2)))
      shard.append((base + SCALE, "U8", (shape[0], shape[1] // 32)))
    else:
      shard.append((name, "F32" if slot.entry.hf_dtype == "f32" else "BF16", shape))
  rng = np.random.default_rng(0)
  weight_map, total, largest = {}, 0, 0
  for i, tensors in enumerate(shards):
    file = f"model-{i + 1:05d}-of-00002.safetensors"
    writer = ShardWriter(os.path.join(folder, file), encode_header(tensors, {"format": "pt"}))
    for name, dtype, shape in tensors:
      nbytes = math.prod(shape) * DTYPES[dtype].itemsize
      if name.endswith("A_log"):
        data = np.zeros(shape, np.float32)
        data[:96] = rng.uniform(-1, 1.5, 96)
      elif dtype == "U8":
        data = np.frombuffer(rng.bytes(nbytes), np.uint8).reshape(shape)
      else:  # random mantissas and signs, exponent fixed: values in +-[0.5, 1), no NaN
        bits = np.frombuffer(rng.bytes(nbytes), FLOAT_BITS[dtype][0])
        data = ((bits & FLOAT_BITS[dtype][1]) | FLOAT_BITS[dtype][2]).view(DTYPES[dtype])
        data = data.reshape(shape)
      writer.write(name, data)
      weight_map[name] = file
      total += nbytes
      largest = max(largest, nbytes)
    writer.close()
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return total, largest


def drop_cache(folder: str) -> None:
  """Evict the folder's files from the page cache (no root needed), so reads hit the disk."""
  os.sync()
  for name in os.listdir(folder):
    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def raw_read(folder: str) -> float:
  drop_cache(folder)
  buf = bytearray(64 << 20)
  t = time.perf_counter()
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      with open(os.path.join(folder, name), "rb", buffering=0) as f:
        while f.readinto(buf):
          pass
  return time.perf_counter() - t


def raw_copy(folder: str, dest: str) -> float:
  """Read the shards and write them to `dest` as they are, synced: what any converter that
  writes about as many bytes as it reads cannot beat on this disk."""
  drop_cache(folder)
  os.makedirs(dest)
  buf = bytearray(64 << 20)
  t = time.perf_counter()
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      with open(os.path.join(folder, name), "rb", buffering=0) as src, \
          open(os.path.join(dest, name), "wb", buffering=0) as dst:
        while n := src.readinto(buf):
          dst.write(memoryview(buf)[:n])
        os.fsync(dst.fileno())
  return time.perf_counter() - t


def run_convert(src: str, out: str, experts: str, chunk_mib: float | None = None,
                processes: int = 1) -> tuple[float, list[int], list[int]]:
  """(wall seconds, peak RSS bytes of each process, source bytes each process read; empty
  for one process) of `k3jax convert` in fresh processes: one, or `processes` of one
  multi-process conversion (localhost coordinator)."""
  drop_cache(src)
  repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
  # VmHWM, the peak RSS of this process image: ru_maxrss would also count the pages the
  # child shared with this (large) parent between fork and exec.
  chunk = ("" if chunk_mib is None else
           f"from convert import orbax_io; orbax_io.CHUNK_BYTES = {int(chunk_mib * 2**20)}; ")
  code = (chunk + "import sys; from k3jax.cli import main; rc = main(sys.argv[1:]); "
          "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
          "sys.exit(rc)")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [repo, *filter(None, [os.environ.get("PYTHONPATH")])]), "JAX_PLATFORMS": "cpu"}
  argv = [sys.executable, "-c", code, "convert", src, out, "--experts", experts, "--quiet"]
  if processes > 1:
    with socket.socket() as s:
      s.bind(("localhost", 0))
      argv += ["--coordinator", f"localhost:{s.getsockname()[1]}",
               "--num-processes", str(processes)]
  t = time.perf_counter()
  procs = [subprocess.Popen(argv + (["--process-id", str(i)] if processes > 1 else []),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(processes)]
  outs = [p.communicate() for p in procs]
  wall = time.perf_counter() - t
  rss, reads = [], []
  for p, (stdout, stderr) in zip(procs, outs):
    if p.returncode != 0:
      raise SystemExit(f"convert failed:\n{stdout}\n{stderr}")
    rss.append(1024 * next(int(l.split()[1]) for l in stdout.splitlines()
                           if l.startswith("VmHWM")))  # kB
    reads += [int(l.split(", ")[1].split()[0]) for l in stdout.splitlines()
              if l.endswith(" bytes read")]  # "process i/n: T tensors, B bytes read"
  return wall, rss, reads


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--experts", type=int, default=128, help="routed experts in the MoE layer")
  p.add_argument("--vocab", type=int, default=16384)
  p.add_argument("--workdir", default=tempfile.gettempdir())
  p.add_argument("--chunk-mib", type=float, default=None,
                 help="the checkpoint's chunk size limit (default: the converter's)")
  p.add_argument("--no-raw", action="store_true", help="skip the raw read and copy")
  p.add_argument("--processes", type=int, default=1,
                 help="convert as this many processes on this machine (peak RSS per process)")
  args = p.parse_args()
  root = tempfile.mkdtemp(prefix="k3jax-convert-bench-", dir=args.workdir)
  try:
    src = os.path.join(root, "hf")
    os.makedirs(src)
    t = time.perf_counter()
    total, largest = build(src, args.experts, args.vocab)
    print(f"synthetic K3-shaped checkpoint: {total / GiB:.2f} GiB in 2 shards, largest tensor "
          f"{largest / GiB:.3f} GiB (built in {time.perf_counter() - t:.0f}s)")
    raw = copy = math.nan
    if not args.no_raw:
      raw = raw_read(src)
      print(f"raw read:                 {raw:6.1f}s  {total / raw / GiB:6.2f} GiB/s")
      copy = raw_copy(src, os.path.join(root, "copy"))
      shutil.rmtree(os.path.join(root, "copy"))
      print(f"raw copy (read + write):  {copy:6.1f}s  {total / copy / GiB:6.2f} GiB/s "
            f"({100 * raw / copy:5.1f}% of raw read)")
    bound = 2 * largest + GiB
    for experts in ("bf16", "mxfp4"):
      out = os.path.join(root, f"out_{experts}")
      wall, rss, reads = run_convert(src, out, experts, args.chunk_mib, args.processes)
      files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs]
      size = sum(map(os.path.getsize, files))
      peaks = " + ".join(f"{r / GiB:.2f}" for r in rss)
      vs_raw = "" if math.isnan(raw) else (f" ({100 * raw / wall:5.1f}% of raw read, "
                                            f"{100 * copy / wall:5.1f}% of raw copy)")
      print(f"convert --experts {experts:5s}: {wall:6.1f}s  {total / wall / GiB:6.2f} GiB/s"
            f"{vs_raw}, "
            f"wrote {size / GiB:.2f} GiB in {len(files)} files, peak RSS "
            f"{peaks} GiB (bound 2 x largest + 1 GiB = {bound / GiB:.2f} GiB a process: "
            f"{'ok' if max(rss) <= bound else 'EXCEEDED'})")
      if reads:
        print("  source bytes each process read: " + ", ".join(
            f"{r / GiB:.2f} GiB ({r / sum(reads):.1%})" for r in reads)
            + f" of {sum(reads) / GiB:.2f} GiB")
      shutil.rmtree(out)
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
