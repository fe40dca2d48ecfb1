"""Expert-parallel MoE layer vs the same layer under plain jit, on 8 fake CPU devices.

    python benchmarks/moe_ep.py                       # mesh expert=8, 2048 tokens, float32
    python benchmarks/moe_ep.py --mesh data=2,expert=4 --tokens 4096
    python benchmarks/moe_ep.py --quick               # 512 tokens, 2 reps: a smoke run

A K3-shaped LatentMoE layer scaled down (d 1024, latent 512, 64 experts of width 448 = K3's
6/7 of the latent, top 8, two shared experts), parameters placed by sharding/rules.py. One
step = forward + backward (gradient of sum(sin(y)) w.r.t. every parameter and x). Programs:

  one device   the layer on one device, nothing sharded (the work of the whole batch)
  plain jit    the same sharded parameters and tokens under jit without a mesh context: the
               one-device code, partitioned by XLA (it gathers every token's choices to every
               device and all-reduces [N*k, l] rows per expert matmul)
  EP dropless  under `jax.set_mesh`: k3jax/model/expert_parallel.py with worst-case buffers
  EP cap c     the same with moe_capacity_factor=c (pairs past each expert's cap dropped)

Bytes are read from each compiled program's HLO: for every collective its operand size (what
the brief counts) and the bytes a device receives (all-gather and all-to-all (g-1)/g of the
result, all-reduce 2(g-1)/g as a ring, reduce-scatter (g-1)/g of the operand). The padded
all_to_all moves its whole worst-case buffer; the ragged_all_to_all of TPU/GPU would move only
the routed rows, counted here from this batch's routing ("ragged payload").

Times: wall-clock and process CPU seconds per step (median); on a shared machine the CPU time
is the steadier measure of the work (the 8 fake devices run on this machine's cores).

What fake devices show: the collectives the partitioner and shard_map put in the program and
their sizes (exact), and the total compute of all devices (the 8 share this machine's cores,
so a step's time is the sum of their work plus copies). What they cannot: communication time
(a collective is a memcpy here: no link bandwidth, latency or overlap), per-chip speed, the
ragged_all_to_all (XLA:CPU has none) or a grouped-matmul kernel that skips the empty rows of
a worst-case buffer (the CPU tiled matmul computes all of them).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import configs
from k3jax.execution import Execution
from k3jax.model import expert_parallel
from k3jax.model.moe import MoE
from sharding.activations import activation_spec
from sharding.mesh import make_mesh
from sharding.placement import variable_spec

COLLECTIVE = re.compile(r"= (\S+|\(.*?\)) (all-to-all|ragged-all-to-all|all-gather|all-reduce|"
                        r"reduce-scatter|collective-permute)(?:-start)?\((.*)$")
SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
BYTES = {"pred": 1, "bf16": 2}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--mesh", default="expert=8", help="axis=size,... over data,fsdp,expert,tensor")
  p.add_argument("--tokens", type=int, default=2048, help="tokens per step (whole batch)")
  p.add_argument("--seq", type=int, default=256, help="tokens per row")
  p.add_argument("--capacity", type=float, default=2.0, help="capacity factor of 'EP cap'")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--reps", type=int, default=3, help="timed steps per number (median)")
  p.add_argument("--quick", action="store_true", help="512 tokens, 2 reps")
  args = p.parse_args(argv)
  if args.quick:
    args.tokens, args.seq, args.reps = 512, 64, 2
  return args


def layer_config(args):
  return configs.get("tiny", hidden_size=1024, latent_size=512, num_experts=64,
                     num_experts_per_token=8, moe_intermediate_size=448, num_shared_experts=2)


def layer_execution(args, capacity_factor):
  return Execution(dtype=args.dtype, param_dtype="float32", moe_capacity_factor=capacity_factor)


def placed(state, mesh):
  """The layer's variables in their shardings (sharding/placement.py, the train step's)."""
  def put(v):
    return v.replace(jax.device_put(v.get_value(), NamedSharding(mesh, variable_spec(v, mesh))))
  return jax.tree.map(put, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def step_fn(graphdef):
  def loss(state, x):
    y, r = nnx.merge(graphdef, state)(x)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))), (r.experts_nk, r.dropped_pairs)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def group_size(line: str, mesh) -> int:
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line):
    sizes = {k.strip("' "): int(v) for k, v in (a.split("=") for a in m.group(1).split(","))}
    return int(np.prod([sizes[a.strip("' ")] for a in m.group(2).split(",") if a]))
  if m := re.search(r"replica_groups=\[([\d,]+)\]<=", line):
    return int(m.group(1).split(",")[-1])
  if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
    return len(m.group(1).split(","))
  return mesh.size


def collective_bytes(hlo: str, mesh):
  """{op: [count, operand bytes, received bytes]} per device for one compiled program."""
  out = {}
  for line in hlo.splitlines():
    m = COLLECTIVE.search(line)
    if not m:
      continue
    op = m.group(2)
    size = sum(BYTES.get(t, int(t[1:]) // 8 if t[1:].isdigit() else 4)
               * int(np.prod([int(d) for d in dims.split(",") if d]))
               for t, dims in SHAPE.findall(m.group(1)))
    g = group_size(line, mesh)
    operand = {"all-gather": size / g, "reduce-scatter": size * g}.get(op, size)
    received = {"all-reduce": 2 * size * (g - 1) / g, "reduce-scatter": size * (g - 1),
                "collective-permute": size}.get(op, size * (g - 1) / g)
    row = out.setdefault(op, [0, 0.0, 0.0])
    row[0] += 1
    row[1] += operand
    row[2] += received
  return out


def timed(fn, *a, reps):
  """(wall s, process CPU s) per call, medians."""
  jax.block_until_ready(fn(*a))
  wall, cpu = [], []
  for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*a))
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return statistics.median(wall), statistics.median(cpu)


def ragged_payload(experts_nk, mesh, cfg, plan, dtype):
  """Bytes one device sends to others (median over devices) in one exchange of this batch,
  as ragged_all_to_all would move them: the routed rows only."""
  ep, n = plan.ep, plan.n
  e_loc = cfg.num_experts // ep
  dest = np.asarray(experts_nk).reshape(-1, n, cfg.num_experts_per_token) // e_loc
  if ep == 1:
    return 0.0
  # devices along the expert axis: token block b sits on expert coordinate b % ep
  sent = [(dest[b] != b % ep).sum() for b in range(dest.shape[0])]
  return float(np.median(sent)) * cfg.latent_size * jnp.dtype(dtype).itemsize


def main(argv=None):
  args = parse_args(argv)
  mesh = make_mesh(args.mesh)
  rows = args.tokens // args.seq
  x = jax.random.normal(jax.random.key(1), (rows, args.seq, 1024), jnp.float32)
  x_sharded = jax.device_put(x, NamedSharding(mesh, activation_spec(
      ("batch", None, None), x.shape, mesh)))
  print(f"# MoE layer d=1024 l=512 E=64 k=8 F=448 (+2 shared), {args.tokens} tokens, "
        f"{args.dtype}, mesh {args.mesh}, {jax.device_count()} fake CPU devices, "
        f"median of {args.reps}")
  results = []
  for name, factor, ctx, xs in [("one device", None, None, x),
                                ("plain jit", None, None, x_sharded),
                                ("EP dropless", None, mesh, x_sharded),
                                (f"EP cap {args.capacity:g}", args.capacity, mesh, x_sharded)]:
    cfg, ex = layer_config(args), layer_execution(args, factor)
    graphdef, state = nnx.split(MoE(cfg, ex, rngs=nnx.Rngs(0)))
    if xs is not x:
      state = placed(state, mesh)
    fn = step_fn(graphdef)
    with jax.set_mesh(ctx) if ctx is not None else _null():
      t0 = time.perf_counter()
      compiled = fn.lower(state, xs).compile()
      compile_s = time.perf_counter() - t0
      secs = timed(compiled, state, xs, reps=args.reps)
      (_, (experts, dropped)), _ = compiled(state, xs)
      plan = expert_parallel.layout(cfg, args.tokens, "latent", mesh if ctx else None, factor)
    coll = collective_bytes(compiled.as_text(), mesh) if xs is not x else {}
    ragged = (2 * 2 * ragged_payload(experts, mesh, cfg, plan, args.dtype) if ctx is not None
              else None)
    results.append((name, secs, compile_s, coll, int(dropped), ragged))

  (base_wall, base_cpu) = results[1][1]
  print(f"{'program':<13}{'wall s':>8}{'vs plain':>9}{'cpu s':>8}{'vs plain':>9}{'compile s':>10}"
        f"{'operand MB':>11}{'recv MB':>9}{'dropped':>8}  collectives (count)")
  for name, (wall, cpu), compile_s, coll, dropped, _ in results:
    operand = sum(r[1] for r in coll.values()) / 2**20
    recv = sum(r[2] for r in coll.values()) / 2**20
    kinds = ", ".join(f"{op} {r[0]}" for op, r in sorted(coll.items()))
    print(f"{name:<13}{wall:>8.2f}{base_wall / wall:>8.2f}x{cpu:>8.2f}{base_cpu / cpu:>8.2f}x"
          f"{compile_s:>10.1f}{operand:>11.1f}{recv:>9.1f}{dropped:>8}  {kinds or '-'}")
  print("\nper device and step; by collective: operand MB / received MB")
  for name, _, _, coll, _, ragged in results[1:]:
    parts = "; ".join(f"{op} {r[1] / 2**20:.1f} / {r[2] / 2**20:.1f}"
                      for op, r in sorted(coll.items()))
    print(f"  {name:<12} {parts}")
    if ragged is not None:
      a2a = coll.get("all-to-all", [0, 0.0, 0.0])[2] / 2**20
      print(f"  {'':<12} padded all-to-all receives {a2a:.1f} MB; ragged payload of this "
            f"batch (4 exchanges, routed rows only, sent off-device): {ragged / 2**20:.1f} MB")


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


if __name__ == "__main__":
  main()
