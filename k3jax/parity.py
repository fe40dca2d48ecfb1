"""`k3jax parity`: run a model on a reference file's tokens and compare with its outputs.

MODEL_DIR is an official K3 / Kimi-Linear folder or a converted k3jax checkpoint. The
reference `.npz` holds `input_ids` [B, T] and `logits` (and, in the k3jax reference files,
`logits_fp64`, the official code run in float64, plus `layer_out_i` / `hidden_last`).

Verdict (SPEC §8, ../shared/reference/README.md), against `logits_fp64` when present:
  float64   max |logit diff| <= 1e-5 (the float32 rounding of the stored truth)
  float32   max |logit diff| <= 2e-3 (the float32 noise floor of the random tiny network: the
            official float32 run itself is 4e-4..6e-4 away) and the same argmax everywhere
  bfloat16  the same argmax on >= 99% of positions
A file with only (float32) `logits` carries float32 noise itself, so float64 and float32 runs
are then held to the float32 rule. Per-layer differences are reported, not judged: the stored
`layer_out_i` come from the official float32 run, so even an exact float64 run sits at the
float32 noise floor there (~1e-6 at layer 0, growing to ~1e-4..1e-3 with depth). For a
partial checkpoint (a prefix converted with --layers) only those layers can be compared, and
they are judged by the float32 noise floor.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from k3jax.cli import UserError

TOLERANCE = {"float64": 1e-5, "float32": 2e-3}
FLOAT32_NOISE = 2e-3
BF16_ARGMAX = 0.99
NUMERICS = {
    "float64": dict(dtype="float64", param_dtype="float64", matmul_precision="highest"),
    "float32": dict(dtype="float32", param_dtype="float32", matmul_precision="highest"),
    "bfloat16": dict(dtype="bfloat16", param_dtype="bfloat16", matmul_precision="default"),
}


def load_reference(path: str) -> dict[str, np.ndarray]:
  try:
    with np.load(path, allow_pickle=False) as f:  # never unpickle a file we were handed
      ref = {k: f[k] for k in f.files}
  except (OSError, ValueError) as e:
    raise UserError(f"{path}: not a readable .npz reference ({e})") from None
  if "input_ids" not in ref:
    raise UserError(f"{path}: no input_ids array")
  if "logits" not in ref and "logits_fp64" not in ref:
    raise UserError(f"{path}: neither logits nor logits_fp64")
  return ref


def _load_on_mesh(model_dir: str, dtype: str, mesh):
  """(model, cfg) with every array in its sharding on `mesh` (sharding/rules.py): a k3jax
  checkpoint is restored by Orbax straight into the shards; an official-layout folder is read
  into host memory and then placed (convert it first for a model that does not fit one host)."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415

  import configs  # noqa: PLC0415
  from convert.hf_load import abstract_state  # noqa: PLC0415
  from convert.load import is_checkpoint, load_any, load_checkpoint  # noqa: PLC0415
  from sharding.placement import check_model_fits, variable_spec  # noqa: PLC0415

  cfg = configs.resolve(model_dir, **NUMERICS[dtype])
  variables = abstract_state(cfg)
  check_model_fits(nnx.from_flat_state(variables), mesh)  # before reading anything
  shardings = {path: NamedSharding(mesh, variable_spec(var)) for path, var in variables.items()}
  if is_checkpoint(model_dir):
    model, cfg = load_checkpoint(model_dir, allow_partial=True, shardings=shardings,
                                 **NUMERICS[dtype])
  else:
    model, cfg = load_any(model_dir, **NUMERICS[dtype])
  graphdef, state = nnx.split(model)
  flat = [(path, var) for path, var in nnx.to_flat_state(state)]
  placed = [jax.device_put(var.get_value(), shardings[tuple(str(p) for p in path)])
            for path, var in flat]
  for (_, var), value in zip(flat, placed):
    var.set_value(value)
  return nnx.merge(graphdef, state), cfg


def run_model(model_dir: str, ids: np.ndarray, dtype: str, layers: bool = False,
              mesh: str | None = None) -> dict:
  """The model's outputs on `ids` in `dtype` (float64 arrays): logits, layer_out, hidden.
  `mesh` (a spec such as "data=2,expert=2,tensor=2") runs it sharded (SPEC §6)."""
  import contextlib  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from convert.load import load_any, read_manifest  # noqa: PLC0415

  with jax.enable_x64(dtype == "float64"):
    if mesh is not None:
      from sharding.mesh import make_mesh  # noqa: PLC0415
      device_mesh = make_mesh(mesh)
      model, cfg = _load_on_mesh(model_dir, dtype, device_mesh)
    else:
      model, cfg = load_any(model_dir, **NUMERICS[dtype])
    partial = (read_manifest(model_dir) or {}).get("layers") if os.path.isdir(model_dir) else None
    ids = jnp.asarray(ids, jnp.int32)
    if int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
      raise UserError(f"input_ids outside the vocabulary [0, {cfg.vocab_size})")
    want_layers = layers or partial is not None
    with jax.set_mesh(device_mesh) if mesh is not None else contextlib.nullcontext():
      out = nnx.jit(lambda m, x: m(x, return_layer_out=want_layers))(model, ids)
    return {"model": model_dir, "dtype": dtype, "num_layers": cfg.num_layers,
            "partial_layers": partial,
            "logits": np.asarray(out.logits, np.float64),
            "layer_out": [np.asarray(a, np.float64) for a in out.layer_out],
            "hidden": np.asarray(out.hidden, np.float64)}


def judge(out: dict, ref: dict[str, np.ndarray]) -> dict:
  """The report and verdict for model outputs `out` (see run_model) against `ref`."""
  dtype, partial = out["dtype"], out["partial_layers"]
  layers = {i: float(np.abs(a - ref[f"layer_out_{i}"]).max())
            for i, a in enumerate(out["layer_out"]) if f"layer_out_{i}" in ref}
  report = {"model": out["model"], "dtype": dtype, "num_layers": out["num_layers"],
            "layer_max_abs_diff": layers}
  if partial is not None:
    if not layers:
      raise UserError(f"{out['model']} holds layers {partial[0]}-{partial[1]} only and the "
                      "reference has no layer_out_i to compare them with")
    worst = max(layers.values())
    report.update(partial_layers=partial, max_abs_layer_diff=worst, max_abs_logit_diff=None,
                  argmax_agreement=None, tolerance=FLOAT32_NOISE,
                  passed=bool(dtype != "bfloat16" and worst <= FLOAT32_NOISE))
    return report

  logits = out["logits"]
  key = "logits_fp64" if "logits_fp64" in ref else "logits"
  truth = ref[key].astype(np.float64)
  if truth.shape != logits.shape:
    raise UserError(f"reference {key} has shape {list(truth.shape)}, the model gives "
                    f"{list(logits.shape)}")
  diff = float(np.abs(logits - truth).max())
  agree = float((logits.argmax(-1) == truth.argmax(-1)).mean())
  if dtype == "bfloat16":
    tol, passed = None, agree >= BF16_ARGMAX
  else:
    exact = dtype == "float64" and key == "logits_fp64"
    tol = TOLERANCE["float64"] if exact else FLOAT32_NOISE
    passed = diff <= tol and (exact or agree == 1.0)
  report.update(compared_to=key, max_abs_logit_diff=diff, argmax_agreement=agree,
                tolerance=tol, passed=bool(passed))
  if "hidden_last" in ref:
    report["hidden_last_max_abs_diff"] = float(np.abs(out["hidden"] - ref["hidden_last"]).max())
  return report


def compare(model_dir: str, ref: dict[str, np.ndarray], dtype: str,
            mesh: str | None = None) -> dict:
  """Run the model in `dtype` on ref["input_ids"]; every number of the report, and the verdict."""
  layers = any(k.startswith("layer_out_") for k in ref)
  report = judge(run_model(model_dir, ref["input_ids"], dtype, layers, mesh), ref)
  if mesh is not None:
    report["mesh"] = mesh
  return report


def format_report(r: dict) -> str:
  lines = [f"model {r['model']} ({r['num_layers']} layers), {r['dtype']}"
           + (f", mesh {r['mesh']}" if r.get("mesh") else "")]
  if r.get("partial_layers") is not None:
    lines.append(f"partial checkpoint: layers {r['partial_layers'][0]}-{r['partial_layers'][1]}; "
                 f"logits not compared")
  else:
    lines.append(f"max |logit diff| vs {r['compared_to']}: {r['max_abs_logit_diff']:.3e}"
                 + (f" (tolerance {r['tolerance']:.0e})" if r["tolerance"] else ""))
    lines.append(f"argmax agreement: {100 * r['argmax_agreement']:.2f}%")
    if "hidden_last_max_abs_diff" in r:
      lines.append(f"hidden_last max |diff|: {r['hidden_last_max_abs_diff']:.3e}")
  if r["layer_max_abs_diff"]:
    lines.append("per layer max |diff| vs layer_out_i (reference from the official float32 run):")
    lines += [f"  layer {i:3d}: {d:.3e}" for i, d in r["layer_max_abs_diff"].items()]
  lines.append("PASS" if r["passed"] else "FAIL")
  return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
  if not os.path.exists(args.model_dir):
    raise UserError(f"{args.model_dir}: no such folder")
  ref = load_reference(args.reference)
  report = compare(args.model_dir, ref, args.dtype, args.mesh)
  report["reference"] = args.reference
  if args.json:
    print(json.dumps(report))
  else:
    print(format_report(report))
  return 0 if report["passed"] else 1


def register(sub) -> None:
  p = sub.add_parser("parity", help="compare a model's logits with a PyTorch reference file",
                     description=__doc__.splitlines()[0],
                     epilog="Exit 0 within tolerance, 1 outside it, 2 on bad input.")
  p.add_argument("model_dir", metavar="MODEL_DIR",
                 help="official K3 / Kimi-Linear folder, or a converted k3jax checkpoint")
  p.add_argument("--reference", required=True, metavar="NPZ",
                 help=".npz with input_ids and logits (and logits_fp64, layer_out_i)")
  p.add_argument("--dtype", choices=tuple(NUMERICS), default="float32")
  p.add_argument("--mesh", default=None, metavar="SPEC",
                 help="run sharded on a device mesh, e.g. data=2,expert=2,tensor=2 (SPEC 6)")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.set_defaults(func=run)
