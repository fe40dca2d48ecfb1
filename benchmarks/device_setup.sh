#!/usr/bin/env bash
# On the GPU machine (docs/benchmarks.md#a-window-on-one-gpu): install the wheels carried in
# .device/wheels into a folder outside the tree, without a network, put that folder first on
# the Python path (over the image's jax), and run benchmarks/device_check.py with the arguments.
#
#     bash benchmarks/device_setup.sh --out "$OUT/device_check" --budget-s 300
#
# PYTHON (default python3), K3JAX_WHEELS (.device/wheels) and K3JAX_SITE (/tmp/k3jax-site)
# override the defaults; K3JAX_IMAGE_JAX=1 installs every carried wheel but jax's, leaving the
# image's jax (the fallback if jax 0.12 over the image's jaxlib fails there). Compiles are cached in JAX_COMPILATION_CACHE_DIR (default
# /tmp/k3jax-xla-cache), so a second command on the same machine skips the long ones.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${K3JAX_WHEELS:-.device/wheels}
SITE=${K3JAX_SITE:-/tmp/k3jax-site}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/k3jax-xla-cache}

echo "== host $(uname -m), $(nproc) CPUs, $("$PY" --version 2>&1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
echo "== ptxas on PATH: $(command -v ptxas || echo none)"  # XLA runs it (or the CUDA wheels')
"$PY" - <<'PYEOF' || true
import importlib.metadata as m
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "numpy", "scipy", "ml_dtypes", "torch", "triton", "flax", "optax", "fla-core", "pip"):
  try:
    version = m.version(name)
  except m.PackageNotFoundError:
    version = None
  print(f"== image {name} {version}")
PYEOF

if [ -d "$WHEELS" ]; then
  t0=$SECONDS
  requirements=$(mktemp)
  if [ "${K3JAX_IMAGE_JAX:-0}" = 1 ]; then
    grep -v '^jax==' benchmarks/device_requirements.txt > "$requirements"
  else
    cp benchmarks/device_requirements.txt "$requirements"
  fi
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" \
      --find-links "$WHEELS" -r "$requirements"
  else  # no pip: unpack the listed pure wheels and this machine's binary ones
    "$PY" - "$WHEELS" "$SITE" "$requirements" <<'PYEOF'
import glob, os, platform, sys, zipfile
wheels, site, requirements = sys.argv[1:]
wanted = {line.split("==")[0].lower().replace("-", "_") for line in open(requirements)
          if "==" in line and not line.startswith("#")}
for path in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
  name = os.path.basename(path)
  if name.split("-")[0].lower() in wanted and (
      name.endswith("-none-any.whl") or name.endswith(f"_{platform.machine()}.whl")):
    zipfile.ZipFile(path).extractall(site)
PYEOF
  fi
  echo "== installed the wheels of $WHEELS into $SITE in $((SECONDS - t0)) s"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "== no $WHEELS here: the image's own packages"
fi
"$PY" -c "import jax, jaxlib; print('== jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
'from', jax.__file__); print('==', jax.devices())" 2>&1 || true
exec "$PY" benchmarks/device_check.py "$@"
