"""`k3jax parity`: run a model on a reference file's tokens and compare with its outputs.

MODEL_DIR is an official K3 / Kimi-Linear folder, a converted k3jax checkpoint or a `k3jax
train` output (its model/; the command resolves it, k3jax/folders.py). The reference `.npz`
holds `input_ids` [B, T] and `logits` (and, in the k3jax reference files,
`logits_fp64`, the official code run in float64, plus `layer_out_i` / `hidden_last`,
`decode_logits_fp64` and `logits_bf16_official`).

Verdict (docs/correctness.md#whole-model-rules), against `logits_fp64` when present:
  float64   max |logit diff| <= 1e-5 (the float32 rounding of the stored truth)
  float32   max |logit diff| <= 2e-3 (the float32 noise floor of the random tiny network)
            and the same argmax everywhere
  bfloat16  judged against the official code run in bf16 (`logits_bf16_official`): mean
            KL(truth || model) over positions <= 2x the official bf16 run's, and argmax
            agreement with the truth >= the official's - 0.10 (on these random networks the
            official bf16 run itself is far from the truth). A file without
            `logits_bf16_official` falls back to the same argmax on >= 99% of positions.
A file with only (float32) `logits` carries float32 noise itself, so float64 and float32 runs
are then held to the float32 rule. Per-layer differences are reported, not judged: the stored
`layer_out_i` come from the official float32 run, so even an exact float64 run sits at the
float32 noise floor there, growing with depth. For a
partial checkpoint (a prefix converted with --layers) only those layers can be compared, and
they are judged by the float32 noise floor.

--decode also runs the cache path: prefill the first `decode_prefill_len` tokens, then the
rest one token per step, and judges those logits by the same rule for the dtype against
`decode_logits_fp64` (the official float64 decode; float32 `decode_logits` when absent). In
bf16 the yardstick stays the official bf16 forward (the reference has no official bf16
decode): decode KL from the decode truth <= 2x the official forward's KL from its truth.
Both must pass. --save-logits writes what was computed (float64 arrays) to an .npz.

--mesh MESH runs the model sharded (docs/sharding.md): a converted checkpoint is restored by Orbax
straight into its shards, and the forward (and decode) run under that mesh, the routed experts
expert-parallel; the verdict is the same rule.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.load import load_any, read_manifest
from k3jax.errors import UserError
from k3jax.execution import NUMERICS  # the numerics of each --dtype (also read from here)
from k3jax.generate.static_batch import StaticBatch
from sharding.mesh import make_mesh

TOLERANCE = {"float64": 1e-5, "float32": 2e-3}
FLOAT32_NOISE = 2e-3
BF16_ARGMAX = 0.99        # fallback rule when the file has no logits_bf16_official
BF16_KL_RATIO = 2.0       # docs/correctness.md#bf16: mean KL <= 2x the official bf16 run's
BF16_ARGMAX_SLACK = 0.10  # docs/correctness.md#bf16: argmax agreement >= the official's - 0.10


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


def run_model(model_dir: str, ids: np.ndarray, dtype: str, layers: bool = False,
              decode_prefill: int | None = None, mesh: str | None = None) -> dict:
  """The model's outputs on `ids` in `dtype` (float64 arrays): logits, layer_out, hidden, and
  with `decode_prefill` P the decode logits (prefill P tokens, then one token per step).
  `mesh` (a spec such as "data=2,expert=2,tensor=2") runs it sharded."""
  with jax.enable_x64(dtype == "float64"):
    device_mesh = None
    if mesh is not None:
      device_mesh = make_mesh(mesh)
    model, cfg = load_any(model_dir, NUMERICS[dtype], mesh=device_mesh)
    partial = (read_manifest(model_dir) or {}).get("layers") if os.path.isdir(model_dir) else None
    ids = jnp.asarray(ids, jnp.int32)
    if int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
      raise UserError(f"input_ids outside the vocabulary [0, {cfg.vocab_size})")
    want_layers = layers or partial is not None
    with jax.set_mesh(device_mesh) if device_mesh is not None else contextlib.nullcontext():
      out = _forward(model, ids, want_layers)
      result = {"model": model_dir, "dtype": dtype, "num_layers": cfg.num_layers,
                "partial_layers": partial,
                "logits": np.asarray(out.logits, np.float64),
                "layer_out": [np.asarray(a, np.float64) for a in out.layer_out],
                "hidden": np.asarray(out.hidden, np.float64)}
      if decode_prefill is not None:
        if partial is not None:
          raise UserError(f"{model_dir} holds layers {partial[0]}-{partial[1]} only: --decode "
                          "needs the whole model")
        result["decode_logits"] = decode_logits(model, ids, decode_prefill)
    return result


def _forward(model, ids, layers: bool):
  """The jitted forward, compiled once per model structure and shapes (module-level cache)."""
  global _FORWARD
  if _FORWARD is None:
    _FORWARD = nnx.jit(lambda m, x, layers: m(x, return_layer_out=layers), static_argnums=2)
  return _FORWARD(model, ids, layers)


_FORWARD = None


def decode_logits(model, ids, prefill: int) -> np.ndarray:
  """Logits of every position through the cache: `prefill` tokens at once, then one by one."""
  b, t = ids.shape
  if not 0 < prefill <= t:
    raise UserError(f"decode_prefill_len {prefill} outside [1, {t}]")
  gen = StaticBatch(model)
  logits, cache, extra = gen.prefill(np.asarray(ids[:, :prefill]), np.zeros(b, np.int32),
                                     gen.max_len(prefill, t - prefill))
  outs = [np.asarray(logits[:, extra:], np.float64)]
  for i in range(prefill, t):
    step, cache = gen.extend(jnp.asarray(ids[:, i:i + 1]), cache)
    outs.append(np.asarray(step, np.float64))
  return np.concatenate(outs, axis=1)


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

  truth_key = "logits_fp64" if "logits_fp64" in ref else "logits"
  report.update(compared_to=truth_key, **verdict(out["logits"], ref, truth_key, dtype))
  if "hidden_last" in ref:
    report["hidden_last_max_abs_diff"] = float(np.abs(out["hidden"] - ref["hidden_last"]).max())
  if "decode_logits" in out:
    key = next((k for k in ("decode_logits_fp64", "decode_logits") if k in ref), None)
    if key is None:
      raise UserError("--decode: the reference has no decode_logits_fp64 / decode_logits")
    d = verdict(out["decode_logits"], ref, key, dtype)
    report["decode"] = {"compared_to": key, **d}
    report["max_abs_decode_diff"] = d["max_abs_logit_diff"]
    report["passed"] = bool(report["passed"] and d["passed"])
  return report


def mean_kl(truth: np.ndarray, logits: np.ndarray) -> float:
  """KL(softmax(truth) || softmax(logits)) averaged over positions (float64)."""
  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
  lt, lm = log_softmax(truth.astype(np.float64)), log_softmax(logits.astype(np.float64))
  return float(np.mean(np.sum(np.exp(lt) * (lt - lm), -1)))


def verdict(logits: np.ndarray, ref: dict[str, np.ndarray], key: str, dtype: str) -> dict:
  """Distance of `logits` from ref[key] and the rule for `dtype`
  (docs/correctness.md#whole-model-rules)."""
  truth = ref[key].astype(np.float64)
  if truth.shape != logits.shape:
    raise UserError(f"reference {key} has shape {list(truth.shape)}, the model gives "
                    f"{list(logits.shape)}")
  diff = float(np.abs(logits - truth).max())
  agree = float((logits.argmax(-1) == truth.argmax(-1)).mean())
  r = {"max_abs_logit_diff": diff, "argmax_agreement": agree}
  if dtype == "bfloat16":
    r["mean_kl"] = mean_kl(truth, logits)
    official = ref.get("logits_bf16_official")
    if official is None:
      r.update(tolerance=None, passed=agree >= BF16_ARGMAX)
      return r
    # the official bf16 forward against the forward truth is the yardstick for both paths
    fwd_truth = ref["logits_fp64"] if "logits_fp64" in ref else ref["logits"]
    official = official.astype(np.float64)
    r["official_mean_kl"] = mean_kl(fwd_truth, official)
    r["official_argmax_agreement"] = float(
        (official.argmax(-1) == fwd_truth.argmax(-1)).mean())
    r.update(tolerance=None, passed=bool(
        r["mean_kl"] <= BF16_KL_RATIO * r["official_mean_kl"]
        and agree >= r["official_argmax_agreement"] - BF16_ARGMAX_SLACK))
    return r
  exact = dtype == "float64" and key in ("logits_fp64", "decode_logits_fp64")
  tol = TOLERANCE["float64"] if exact else FLOAT32_NOISE
  r.update(tolerance=tol, passed=bool(diff <= tol and (exact or agree == 1.0)))
  return r


def compare(model_dir: str, ref: dict[str, np.ndarray], dtype: str, decode: bool = False,
            save_logits: str | None = None, mesh: str | None = None) -> dict:
  """Run the model in `dtype` on ref["input_ids"]; every number of the report, and the verdict.
  `decode` adds the cache path; `save_logits` writes the computed logits to an .npz; `mesh`
  runs it sharded on that device mesh."""
  layers = any(k.startswith("layer_out_") for k in ref)
  prefill = None
  if decode:
    if "decode_prefill_len" not in ref:
      raise UserError("--decode: the reference has no decode_prefill_len")
    prefill = int(ref["decode_prefill_len"])
  out = run_model(model_dir, ref["input_ids"], dtype, layers, prefill, mesh)
  report = judge(out, ref)
  if mesh is not None:
    report["mesh"] = mesh
  if save_logits:
    arrays = {"input_ids": np.asarray(ref["input_ids"]), "logits": out["logits"]}
    if "decode_logits" in out:
      arrays.update(decode_logits=out["decode_logits"], decode_prefill_len=np.int32(prefill))
    write_npz(save_logits, arrays)
  return report


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
  """Written aside and moved into place: never a half-written file at `path`."""
  if not path.endswith(".npz"):
    raise UserError(f"--save-logits {path}: expected a .npz path")
  tmp = path[:-4] + ".partial.npz"
  try:
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
  except OSError as e:
    raise UserError(f"--save-logits {path}: {e}") from None


def _format_numbers(r: dict, what: str) -> list[str]:
  lines = [f"{what} max |logit diff| vs {r['compared_to']}: {r['max_abs_logit_diff']:.3e}"
           + (f" (tolerance {r['tolerance']:.0e})" if r.get("tolerance") else "")]
  agree = f"{what} argmax agreement: {100 * r['argmax_agreement']:.2f}%"
  if "mean_kl" in r:
    lines.append(f"{what} mean KL(truth || model): {r['mean_kl']:.4f}"
                 + (f" (official bf16 {r['official_mean_kl']:.4f}, limit "
                    f"{BF16_KL_RATIO * r['official_mean_kl']:.4f})" if "official_mean_kl" in r
                    else ""))
    if "official_argmax_agreement" in r:
      agree += (f" (official bf16 {100 * r['official_argmax_agreement']:.2f}%, limit "
                f"{100 * (r['official_argmax_agreement'] - BF16_ARGMAX_SLACK):.2f}%)")
  return lines + [agree]


def format_report(r: dict) -> str:
  lines = [f"model {r['model']} ({r['num_layers']} layers), {r['dtype']}"
           + (f", mesh {r['mesh']}" if r.get("mesh") else "")]
  if r.get("partial_layers") is not None:
    lines.append(f"partial checkpoint: layers {r['partial_layers'][0]}-{r['partial_layers'][1]}; "
                 f"logits not compared")
  else:
    lines += _format_numbers(r, "forward")
    if "hidden_last_max_abs_diff" in r:
      lines.append(f"hidden_last max |diff|: {r['hidden_last_max_abs_diff']:.3e}")
    if "decode" in r:
      lines += _format_numbers(r["decode"], "decode")
  if r["layer_max_abs_diff"]:
    lines.append("per layer max |diff| vs layer_out_i (reference from the official float32 run):")
    lines += [f"  layer {i:3d}: {d:.3e}" for i, d in r["layer_max_abs_diff"].items()]
  lines.append("PASS" if r["passed"] else "FAIL")
  return "\n".join(lines)
