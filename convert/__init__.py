"""Official safetensors <-> k3jax (Orbax) conversion (SPEC §3).

    k3jax convert HF_DIR OUT_DIR [--layers A-B] [--experts bf16|mxfp4] [--force] [--quiet]
    k3jax export  CKPT_DIR OUT_DIR [--num-shards N] [--force] [--quiet]
    k3jax parity  MODEL_DIR --reference NPZ [--dtype float64|float32|bfloat16] [--json]

Modules, in the order data flows through them:
  name_map        THE table: HF name <-> k3jax path(s), stack, dtype, layout transform + inverse
  safetensors_io  header validation before any read; streaming shard writer (safetensors' own
                  byte layout, or a recorded header reproduced exactly)
  source          an HF folder checked against its config and planned as reads in file order
  mxfp4           exact dequantisation; OCP MX quantisation (E8M0 scales, round to nearest even)
  orbax_io        the Orbax checkpoint written slice by slice; standard Orbax restore
  to_orbax        `convert`;  to_hf: `export`;  load: checkpoint -> model;  hf_load: folder ->
                  model in memory (tests, parity)
  outdir          outputs appear whole or not at all;  progress: bytes, rate, ETA on stderr
  cli             the `convert` / `export` subcommands (`parity` lives in k3jax/parity.py)

A converted checkpoint restores with the standard Orbax API into the model's abstract state:

    cfg = configs.resolve(ckpt)          # reads ckpt/k3jax_config.json
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, ocp.StandardCheckpointer().restore(ckpt, abstract))

(or `convert.load.load_checkpoint(ckpt, **overrides)`, which also handles `--experts mxfp4`
checkpoints and `--layers` prefixes).
"""
