"""Mesh specs, the device lists a mesh can be built on, and refusing impossible meshes in one
line before anything compiles (docs/sharding.md)."""

import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import configs
from k3jax.cli import main
from k3jax.model.transformer import K3Model
from sharding import constrain
from sharding.mesh import MeshError, axis_sizes, make_mesh, parse_mesh_spec
from sharding.placement import check_batch, check_model_fits
from sharding.rules import MESH_AXES


def test_spec_grammar():
  assert parse_mesh_spec("data=2,fsdp=1,expert=2,tensor=2") == {
      "data": 2, "fsdp": 1, "expert": 2, "tensor": 2}
  assert axis_sizes("expert=4,tensor=2", 8) == {"data": 1, "fsdp": 1, "expert": 4, "context": 1,
                                                 "tensor": 2}
  assert axis_sizes("data=-1,tensor=2", 8) == {"data": 4, "fsdp": 1, "expert": 1, "context": 1,
                                                "tensor": 2}
  assert axis_sizes(" fsdp = 8 ", 8)["fsdp"] == 8
  for spec, needle in [("", "empty"), ("data:2", "AXIS=SIZE"), ("pipe=2", "unknown axis"),
                       ("data=2,data=4", "twice"), ("data=0", ">= 1"),
                       ("data=-1,fsdp=-1", "at most one"), ("data=2,tensor=2", "has 4 devices"),
                       ("data=-1,tensor=3", "not a multiple")]:
    with pytest.raises(MeshError, match=needle):
      axis_sizes(spec, 8)


def test_mesh_on_any_device_list():
  mesh = make_mesh("data=2,expert=2,tensor=2")
  assert mesh.axis_names == MESH_AXES and dict(mesh.shape) == {
      "data": 2, "fsdp": 1, "expert": 2, "context": 1, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  four = jax.devices()[4:]
  sub = make_mesh("tensor=-1", four)
  assert sorted(d.id for d in sub.devices.flat) == [d.id for d in four]
  assert dict(sub.shape)["tensor"] == 4


def test_mesh_on_tpu_topology_devices():
  """Ahead-of-time compilation targets: the devices of a TPU topology description (libtpu
  on this CPU machine), no TPU attached."""
  topologies = pytest.importorskip("jax.experimental.topologies")
  try:
    topo = topologies.get_topology_desc("v5e:2x2", "tpu")
  except Exception as e:  # noqa: BLE001  (no libtpu in this environment)
    pytest.skip(f"no TPU topology support here: {e}")
  mesh = make_mesh("data=2,tensor=2", topo.devices)
  assert mesh.size == 4 and mesh.devices.flat[0].platform == "tpu"
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                           sharding=jax.sharding.NamedSharding(mesh, jax.P("data", "tensor")))
  compiled = jax.jit(lambda a: jnp.sum(a * a)).lower(x).compile()
  assert "all-reduce" in compiled.as_text()


def test_model_and_batch_fit_checks():
  abstract = nnx.state(nnx.eval_shape(lambda: K3Model(configs.get("tiny"), rngs=nnx.Rngs(0))))
  check_model_fits(abstract, make_mesh("data=2,expert=2,tensor=2"))
  with pytest.raises(MeshError, match=r"tensor=8 does not divide heads=4 of kda\."):
    check_model_fits(abstract, make_mesh("tensor=8"))
  with pytest.raises(MeshError, match="fsdp=8 does not divide embed=36"):
    check_model_fits(nnx.state(nnx.eval_shape(lambda: K3Model(
        configs.get("tiny").replace(hidden_size=36), rngs=nnx.Rngs(0)))), make_mesh("fsdp=8"))
  check_batch(8, make_mesh("data=2,expert=2,tensor=2"))
  with pytest.raises(MeshError, match="rows per micro-batch = 6 is not a multiple of"):
    check_batch(6, make_mesh("data=2,expert=2,tensor=2"))


def test_constrain_is_a_no_op_without_a_mesh():
  """No context mesh: the model's program has no sharding constraint at all (bit-for-bit the
  program it was); under a mesh, the layer boundaries carry them."""
  cfg = configs.get("tiny").replace(num_layers=2, mla_layers=(1,))
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  ids = jnp.zeros((4, 8), jnp.int32)
  graphdef, state = nnx.split(model)
  fwd = lambda s, x: nnx.merge(graphdef, s)(x).logits
  plain = str(jax.make_jaxpr(fwd)(state, ids))
  assert "sharding_constraint" not in plain
  with jax.set_mesh(make_mesh("data=2,expert=2,tensor=2")):
    meshed = str(jax.make_jaxpr(fwd)(state, ids))
  assert meshed.count("sharding_constraint") >= 3  # embeddings, each layer, logits
  x = jnp.ones((4, 8, 16))
  assert constrain(x, ("batch", "length", "embed")) is x


def _cli(capsys, *args):
  code = main(list(args))
  return code, capsys.readouterr().err


def test_commands_refuse_impossible_meshes_in_one_line(capsys, tmp_path, reference_dir):
  ckpt = f"{reference_dir}/k3_tiny_a"
  cases = [
      (["train", "--out", str(tmp_path / "a"), "--config", "tiny", "--mesh", "data=3"],
       "has 3 devices, but there are 8"),
      (["train", "--out", str(tmp_path / "b"), "--config", "tiny", "--mesh", "tensor=8"],
       "tensor=8 does not divide heads=4"),
      (["train", "--out", str(tmp_path / "c"), "--config", "tiny", "--mesh", "data=8",
        "--batch-size", "4"], "rows per micro-batch = 4 is not a multiple of data x fsdp x "
                              "expert = 8"),
      (["train", "--out", str(tmp_path / "d"), "--config", "tiny", "--coordinator", "x:1"],
       "go together"),
  ]
  parity = [(["parity", ckpt, "--reference", f"{ckpt}/reference.npz", "--mesh", "tensor=8"],
             "tensor=8 does not divide heads=4"),
            (["parity", ckpt, "--reference", f"{ckpt}/reference.npz", "--mesh", "tensor=2,x=4"],
             "unknown axis 'x'")]
  for args, needle in [(a + ["--compile-cache", "none"], n) for a, n in cases] + parity:
    code, err = _cli(capsys, *args)
    assert code == 2, (args, err)
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_cloud_tpu_multihost_environment_is_detected(monkeypatch):
  """`jax.distributed.initialize()` without arguments is called when the environment names
  several TPU workers (not tested here: it would start a distributed client)."""
  from sharding import distributed
  for name in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  assert not distributed._multihost_env()
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0")
  assert not distributed._multihost_env()  # one host: nothing to join
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0,t1v-1")
  assert distributed._multihost_env()


def test_multi_process_cpu_runs_schedule_their_collectives_in_one_order(monkeypatch):
  """A multi-process CPU run turns off XLA:CPU's concurrency-optimised scheduler (its devices
  entered independent collectives in different orders and hung in gloo; the 2-process `long`
  tests run with it off), unless XLA_FLAGS already chooses."""
  from sharding import distributed
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  distributed._serial_cpu_collectives()
  assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4",
                                             distributed.SERIAL_CPU_COLLECTIVES]
  mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
  monkeypatch.setenv("XLA_FLAGS", mine)
  distributed._serial_cpu_collectives()
  assert os.environ["XLA_FLAGS"] == mine
