"""Per-Head Muon on a mesh: what each parameter's update communicates, from compiled programs.

    python benchmarks/muon_sharded.py                          # tiny, fsdp=2,expert=2,tensor=2
    python benchmarks/muon_sharded.py --config k3 --mesh fsdp=4,expert=2 --only experts,kda

For every Muon parameter of the model (abstract shapes: nothing is allocated, so K3 works on a
laptop) the update alone is jitted with the parameter's sharding on the mesh (CPU devices,
faked to the mesh size) and compiled twice: with the whole-block layout
(k3jax/optim/ns_layout.py, the default) and leaving split blocks to XLA's partitioner. Printed
side by side: the placement, the layout Newton-Schulz runs in, and per variant the number of
collectives and the bytes of their results on one device (k3jax/plan/hlo.py), then the totals
and their ratio. Compiling for fake CPU devices shows what is communicated, not how fast.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="tiny", help="preset or config file")
  ap.add_argument("--mesh", default="fsdp=2,expert=2,tensor=2")
  ap.add_argument("--only", default=None,
                  help="comma-separated substrings of parameter paths to keep")
  args = ap.parse_args()

  from sharding.mesh import parse_mesh_spec
  n = 1
  for size in parse_mesh_spec(args.mesh).values():
    if size < 1:
      raise SystemExit("give every axis size explicitly (no -1): the devices are faked")
    n *= size
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={n}")

  import jax
  from flax import nnx

  import configs
  from k3jax.execution import Execution
  from k3jax.model.moe import RouterBias
  from k3jax.model.transformer import K3Model
  from k3jax.optim import dimension_numbers, per_head_muon
  from k3jax.optim.ns_layout import ns_placement
  from k3jax.plan.hlo import collectives, summary
  from sharding.mesh import make_mesh
  from sharding.placement import like_params, variable_spec

  cfg = configs.resolve(args.config)
  mesh = make_mesh(args.mesh)
  # the fp32 master weights Per-Head Muon updates in training (k3jax train, k3jax plan)
  master = Execution(param_dtype="float32")
  model = nnx.eval_shape(lambda: K3Model(cfg, master, rngs=nnx.Rngs(0)))
  _, params, _, _ = nnx.split(model, nnx.Param, RouterBias, ...)
  only = args.only.split(",") if args.only else None
  totals = {False: [0, 0], True: [0, 0]}
  print(f"{args.config} on mesh {args.mesh}: per parameter, collectives / bytes of their "
        "results on one device")
  print(f"{'parameter':34s} {'shape':26s} {'placement -> Newton-Schulz layout':62s} "
        f"{'partitioner':>24s} {'whole blocks':>24s}")
  for path, var in nnx.to_flat_state(params):
    name = ".".join(map(str, path))
    names = tuple(var.get_metadata()["out_sharding"])
    dn = dimension_numbers(names)
    if dn is None or (only and not any(o in name for o in only)):
      continue
    home = variable_spec(var, mesh)  # without the axes of size 1
    sharding = jax.sharding.NamedSharding(mesh, home)
    sds = jax.ShapeDtypeStruct(var.shape, var.get_value().dtype)
    row = {}
    for whole in (False, True):
      tx = per_head_muon(0.01, logical_axes=names, whole_blocks=whole)
      opt = jax.eval_shape(tx.init, sds)
      opt_sh = like_params(opt, sds, sharding, mesh)
      update = jax.jit(tx.update, in_shardings=(sharding, opt_sh, sharding),
                       out_shardings=(sharding, opt_sh))
      with jax.set_mesh(mesh):
        found = collectives(update.lower(sds, opt, sds).compile().as_text())
      count, size = len(found), sum(c.bytes for c in found)
      totals[whole][0] += count
      totals[whole][1] += size
      ops = "+".join(sorted(op.replace("all-", "a").replace("collective-permute", "cp")
                            for op in summary(found)))
      row[whole] = f"{count:3d} {size / 2**20:9.2f} MiB {ops:10s}"
    there, padded, split = ns_placement(home, var.shape, dn, dict(mesh.shape))
    grown = [f"{a}->{b}" for a, b in zip(var.shape, padded) if a != b]  # zero blocks
    layout = (f"[pad {grown[0]}] " if grown else "") + f"{home}" + (
        "" if there == home else f" -> {there}") + (f" split {'x'.join(split)}" if split else "")
    print(f"{name[:34]:34s} {str(tuple(var.shape)):26s} {layout[:62]:62s} {row[False]} "
          f"{row[True]}")
  (n0, b0), (n1, b1) = totals[False], totals[True]
  print(f"total: partitioner {n0} collectives, {b0 / 2**20:.1f} MiB; whole blocks {n1} "
        f"collectives, {b1 / 2**20:.1f} MiB; bytes ratio {b0 / max(b1, 1):.2f}x")


if __name__ == "__main__":
  main()
