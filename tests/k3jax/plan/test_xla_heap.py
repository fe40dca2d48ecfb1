"""k3jax/plan/xla_heap.py reads a dumped buffer assignment: on a small XLA:CPU program its
figures against the same compiled program's own `memory_analysis()` (arguments, temporaries)
and against sizes known from the shapes."""

import json
import os
import subprocess
import sys

from k3jax.plan import xla_heap

N = 512  # [N, N] fp32: 1 MiB a matrix

PROGRAM = f"""
import json, jax, jax.numpy as jnp
def chain(x, w):  # the sorts keep XLA:CPU from fusing it all into one loop
  h = jnp.tanh(x @ w)                              # temporaries: [N, N] each
  g = jnp.sort(jnp.sin(h @ w), axis=0) * h         # h outlives the second matmul
  return jnp.sum(jnp.sort(g @ w + h, axis=1))
args = [jax.ShapeDtypeStruct(({N}, {N}), jnp.float32)] * 2
mem = jax.jit(chain).lower(*args).compile().memory_analysis()
print(json.dumps({{"arg": mem.argument_size_in_bytes, "temp": mem.temp_size_in_bytes}}))
"""


def test_heap_figures_match_the_compiled_program(tmp_path):
  # (no persistent compile cache: a cached program is not compiled, so nothing is dumped)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={tmp_path}",
             JAX_ENABLE_COMPILATION_CACHE="false")
  out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                       text=True, check=True).stdout
  mem = json.loads(out.strip().splitlines()[-1])
  r = xla_heap.summarize(str(tmp_path), "jit_chain")
  matrix = N * N * 4
  assert r["arguments"] == mem["arg"] == 2 * matrix
  # the heap is the temporaries' allocation XLA reports
  assert r["heap"] <= mem["temp"] and r["heap"] >= 0.9 * mem["temp"], (r["heap"], mem)
  # h and a second [N, N] (the next matmul's output) are alive together; all fits the heap
  assert 2 * matrix <= r["max_live"] <= r["heap"]
  assert r["unranged"] == 0
  assert r["at_peak"] and r["at_peak"][0][1] == matrix
  assert r["max_live"] == sum(v[1] for v in r["at_peak"])
