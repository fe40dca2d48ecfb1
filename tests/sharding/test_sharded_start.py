"""Sharded starts of fine-tuning runs (k3jax/run/placement.py `loaded_on_mesh`): 2 processes
x 4 CPU devices on fsdp=8.

  - memory: a 1.22 GB float32 checkpoint started as LoRA, as expert QAT and as LoRA over
    MXFP4 experts, each in fresh processes (after one start the allocator keeps the freed
    pages, so a second start in the same process would look smaller than it is): each
    process's peak RSS while its parameters are placed (load, adapt under jit) grows by at
    most what it must hold, computed from the shardings (its shards of the loaded base, plus
    the adapted leaves that cannot reuse a donated buffer: adapters, MXFP4 codes and scales,
    plus when packing one layer's slice of its expert shards, packed a layer at a time) plus
    SLACK: what does not grow with the model (XLA's compile of the adaptation, 30-115 MiB;
    Orbax's and TensorStore's runtime, ~75 MiB; 140-185 MiB measured). A whole-model load
    would add the whole 1163.5 MiB;
  - numbers: `k3jax train --init-from CKPT --mesh fsdp=8` for 3 steps with `--lora 4
    --base-experts mxfp4`, with `--experts-qat`, and with `--lora 4` from the official layout
    (each process reading its blocks' byte ranges) equals the one-device run (float64, 1e-9).
"""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from k3jax.cli import main
from k3jax.execution import Execution
from k3jax.train import step as step_lib
from k3jax.train.checkpoint import save_model
from k3jax.train.loop import run
from k3jax.train.metrics import read_records
from sharding.mesh import make_mesh
from tests.k3jax.train.helpers import MICRO

from .helpers import run_options
from .test_multiprocess import REPO, cli_args, free_port, process_env

# ~315M parameters: 4 LatentMoE layers of 192 experts of 256 x 512 (1.26 GB in float32)
BIG = MICRO.replace(hidden_size=256, latent_size=256, num_experts=192, moe_intermediate_size=512,
                    intermediate_size=512)
SLACK = 224 * 2**20  # bytes a placement may add beyond its shards (see the module docstring)

MEMORY_DRIVER = """
import gc, json, sys
import jax
import numpy as np
from sharding import distributed
ckpt, name, out, port, pid = sys.argv[1:6]
distributed.initialize(f"localhost:{port}", 2, int(pid))
from convert.load import named_shardings
from convert.variables import abstract_variables
from k3jax.cli import main
from k3jax.execution import Execution
from k3jax.model.lora import AdaptSpec
from k3jax.run.model import model_config
from k3jax.run.placement import initial_params
from sharding.mesh import make_mesh

def status(key):
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def held(leaves):
  return sum(s.data.nbytes for a in leaves for s in a.addressable_shards)

def fresh(params):
  # leaves the adaptation creates: they cannot take over a donated buffer of the base
  return [a for path, a in jax.tree_util.tree_flatten_with_path(params)[0]
          if "lora" in jax.tree_util.keystr(path) or
          jax.tree_util.keystr(path).endswith(("_packed']", "_scale']"))]

mesh, ex = make_mesh("fsdp=8"), Execution()
cfg = model_config(ckpt)
variables = abstract_variables(cfg, ex)
base, layer_slice = 0, 0
for path, sharding in named_shardings(cfg, mesh).items():
  v, held_here = variables[path], 0
  for index in sharding.addressable_devices_indices_map(tuple(v.shape)).values():
    held_here += int(np.prod([len(range(*i.indices(n))) for i, n in zip(index, v.shape)])) * \\
        np.dtype(v.get_value().dtype).itemsize
  base += held_here
  if path[:2] == ("moe", "experts"):  # packed one layer at a time: one layer's slice of it
    layer_slice = max(layer_slice, held_here // v.shape[0])
whole = sum(int(np.prod(v.shape)) * np.dtype(v.get_value().dtype).itemsize
            for v in variables.values())
spec = {"lora": AdaptSpec(rank=4), "qat": AdaptSpec(qat=True),
        "lora_mxfp4": AdaptSpec(rank=4, base_experts="mxfp4")}[name]
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # the peak (VmHWM) starts again from the current RSS
before = status("VmRSS")
params, bias = jax.block_until_ready(initial_params(cfg, ex, spec, ckpt, 0, mesh))
with open(out, "w") as f:
  json.dump({"peak_growth": status("VmHWM") - before, "base_shards": base,
             "fresh_shards": held(fresh(params)), "whole": whole,
             "workspace": layer_slice if spec.base_experts == "mxfp4" else 0,
             "placed_shards": held(jax.tree.leaves((params, bias)))}, f)
"""


def launch(code: str, args: list[str], tmp_path, name: str):
  port = free_port()
  procs, logs = [], []
  for i in range(2):
    logs.append(str(tmp_path / f"{name}_{i}.log"))
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-c", code, *args(i, port)], cwd=REPO,
                                    env=process_env(), stdout=log, stderr=subprocess.STDOUT))
  try:
    codes = [p.wait(1500) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for code_, log in zip(codes, logs):
    with open(log) as f:
      assert code_ == 0, f.read()[-3000:]


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
  """A float32 checkpoint of BIG (random weights), saved as a `k3jax train` run on fsdp=8
  saves its model: each array in chunks of its shards, so a process restoring its shards
  reads those chunks only."""
  path = str(tmp_path_factory.mktemp("big") / "model")
  ex = Execution()
  mesh = make_mesh("fsdp=8")
  steps = step_lib.build(BIG, ex, step_lib.StepConfig(), mesh)
  params, bias = steps.init_params(0)
  save_model(path, steps.graphdef, params, bias, BIG)
  return path


@pytest.mark.long
@pytest.mark.parametrize("name", ["lora", "qat", "lora_mxfp4"])
def test_sharded_starts_hold_only_their_shards(big_checkpoint, tmp_path, name):
  outs = [str(tmp_path / f"memory_{i}.json") for i in range(2)]
  launch(MEMORY_DRIVER, lambda i, port: [big_checkpoint, name, outs[i], str(port), str(i)],
         tmp_path, name)
  for i, out in enumerate(outs):
    with open(out) as f:
      r = json.load(f)
    bound = r["base_shards"] + r["fresh_shards"] + r["workspace"] + SLACK
    print(f"process {i} {name}: peak RSS growth {r['peak_growth'] / 2**20:.1f} MiB, bound "
          f"{bound / 2**20:.1f} MiB (shards {r['base_shards'] / 2**20:.1f} + new "
          f"{r['fresh_shards'] / 2**20:.1f} + packing {r['workspace'] / 2**20:.1f} + slack), "
          "whole model "
          f"{r['whole'] / 2**20:.1f} MiB")
    assert r["whole"] >= 200e6 and r["base_shards"] < 0.6 * r["whole"]
    assert r["peak_growth"] <= bound, (i, name, r)
    assert bound < r["whole"]  # a whole-model load would not fit under the bound


CLI_DRIVER = """
import sys
from k3jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def micro_checkpoint(tmp_path_factory):
  """The float64 micro model every numbers test starts from."""
  path = str(tmp_path_factory.mktemp("micro") / "model")
  ex = Execution(dtype="float64", param_dtype="float64")
  with jax.enable_x64(True):
    steps = step_lib.build(MICRO, ex, step_lib.StepConfig())
    params, bias = step_lib.init_params(MICRO, ex, 0)
    save_model(path, steps.graphdef, params, bias, MICRO)
  return path


ADAPTATIONS = {"lora_mxfp4": (["--lora", "4", "--base-experts", "mxfp4"],
                              {"lora_rank": 4, "base_experts": "mxfp4"}),
               "qat": (["--experts-qat"], {"experts_qat": True}),
               # from the official layout: each process reads its blocks' byte ranges
               "lora_official": (["--lora", "4"], {"lora_rank": 4})}


@pytest.fixture(scope="module")
def micro_official(micro_checkpoint, tmp_path_factory):
  """The micro checkpoint exported to the official safetensors layout."""
  path = str(tmp_path_factory.mktemp("official") / "hf")
  assert main(["export", micro_checkpoint, path, "--quiet"]) == 0
  return path


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(ADAPTATIONS))
def test_sharded_fine_tuning_equals_one_device(micro_checkpoint, micro_official, tmp_path, name):
  flags, fields = ADAPTATIONS[name]
  init = micro_official if name.endswith("official") else micro_checkpoint
  one = run(run_options(tmp_path / "one", None, init_from=init, **fields))
  out = tmp_path / "two"
  args = cli_args(run_options(out, None, init_from=init)) + flags + [
      "--steps", "3", "--mesh", "fsdp=8", "--num-processes", "2"]
  launch(CLI_DRIVER, lambda i, port: args + ["--coordinator", f"localhost:{port}",
                                             "--process-id", str(i)], tmp_path, name)
  got, want = read_records(str(out)), read_records(one["out"])
  assert [r["step"] for r in got] == [1, 2, 3]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-9,
                               err_msg=key)
