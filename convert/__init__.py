"""Official safetensors <-> k3jax (Orbax) conversion (docs/checkpoints.md).

    k3jax convert HF_DIR OUT_DIR [--layers A-B] [--experts bf16|mxfp4] [--force] [--resume]
                  [--quiet] [--coordinator HOST:PORT --num-processes N --process-id I]
    k3jax export  CKPT_DIR OUT_DIR [--num-shards N] [--force] [--quiet]
    k3jax parity  MODEL_DIR --reference NPZ [--dtype float64|float32|bfloat16] [--json]

Modules, in the order data flows through them:
  name_map        THE table: HF name <-> k3jax path(s), stack, dtype, layout transform + inverse
  safetensors_io  header validation before any read; streaming shard writer (safetensors' own
                  byte layout, or a recorded header reproduced exactly)
  source          an HF folder checked against its config and listed as reads in file order
  mxfp4           exact dequantisation; OCP MX quantisation (E8M0 scales, round to nearest even)
  variables       the model's abstract variables (path -> shape, dtype, logical axes)
  orbax_io        the Orbax checkpoint (OCDBT) written tensor by tensor through Orbax's save
                  path (a streaming TypeHandler); standard Orbax restore
  to_orbax        `convert` (resumable);  to_hf: `export`;  load: checkpoint -> model, on one
                  device or a mesh;  hf_load: folder -> model in memory (tests, parity)
  outdir          outputs appear whole or not at all (`--resume` keeps an interrupted one);
                  progress: bytes, rate, ETA on stderr
  cli             the `convert` / `export` subcommands (`parity` lives in k3jax/parity.py)

A converted checkpoint restores with the standard Orbax API into the model's abstract state:

    cfg = configs.resolve(ckpt)          # reads ckpt/k3jax_config.json
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, ocp.StandardCheckpointer().restore(ckpt, abstract))

(the arrays come back as numpy, as they were written, unless the abstract leaves carry a
sharding; `K3Model(cfg, ex, ...)` with an `Execution` restores them in its dtypes), or
`convert.load.load_checkpoint(ckpt, ex, shardings=..., **overrides)`, which also
handles `--experts mxfp4` checkpoints and `--layers` prefixes; with
`shardings=load.named_shardings(cfg, mesh)` every process reads only its own shards.
"""
