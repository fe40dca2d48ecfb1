"""Loading a checkpoint with its routed experts kept as MXFP4 codes + scales (`keep_packed`,
convert/load.py): what `--experts mxfp4` on generate / the engine / the server will load.

k3_tiny_a's experts are MXFP4 as released: a `--experts mxfp4` checkpoint's codes are restored
as they are (no dequantised copy), a bf16 checkpoint's and the official folder's are packed
after loading to the very same codes (exact: their values are MXFP4). The packed model's
logits equal the dequantised model's bit for bit (float64: the packed grouped matmul is the
dequantise-then-multiply reference's dots, tests/pallas_kernels/mxfp4).
"""

import os

import jax
import numpy as np
import pytest
from flax import nnx

import configs
from convert import orbax_io
from convert.load import load_any, load_checkpoint, named_shardings
from k3jax.cli import main
from k3jax.execution import Execution
from sharding.rules import MESH_AXES

F64 = Execution(dtype="float64", param_dtype="float64")
CODES = ("moe", "experts", "w1_packed")


@pytest.fixture(scope="module")
def hf_dir(reference_dir):
  return os.path.join(reference_dir, "k3_tiny_a")


@pytest.fixture(scope="module")
def checkpoints(hf_dir, tmp_path_factory):
  out = {}
  for experts in ("mxfp4", "bf16"):
    out[experts] = str(tmp_path_factory.mktemp(experts) / "ckpt")
    assert main(["convert", hf_dir, out[experts], "--experts", experts, "--quiet"]) == 0
  return out


def _flat(model):
  return {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


@nnx.jit
def logits(model, ids):
  return model(ids).logits


def test_keep_packed_restores_the_codes_and_computes_the_dequantised_model(
    checkpoints, hf_dir):
  saved = np.asarray(orbax_io.open_array(checkpoints["mxfp4"], CODES).read().result())
  ids = np.load(os.path.join(hf_dir, "reference.npz"))["input_ids"][:, :24]
  with jax.enable_x64(True):
    packed, _ = load_checkpoint(checkpoints["mxfp4"], F64, keep_packed=True)
    dense, _ = load_checkpoint(checkpoints["mxfp4"], F64)
    flat = _flat(packed)
    assert ("moe", "experts", "w1") not in flat
    assert flat[CODES].dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(flat[CODES]), saved)
    np.testing.assert_array_equal(np.asarray(logits(packed, ids)),
                                  np.asarray(logits(dense, ids)))
  # bf16 experts (a checkpoint, or the official folder): packed after loading, same codes
  for model, _ in (load_checkpoint(checkpoints["bf16"], keep_packed=True),
                   load_any(hf_dir, keep_packed=True)):
    np.testing.assert_array_equal(np.asarray(_flat(model)[CODES]), saved)


def test_keep_packed_sharded_restore(checkpoints):
  """On a (fsdp 2, expert 2, tensor 2) mesh the codes and scales arrive in the shardings of
  the rules table (`named_shardings(keep_packed=True)`), each shard the one-device value."""
  path = checkpoints["mxfp4"]
  mesh = jax.make_mesh((1, 2, 2, 1, 2), MESH_AXES)
  shardings = named_shardings(configs.resolve(path), mesh, keep_packed=True)
  got = _flat(load_checkpoint(path, shardings=shardings, keep_packed=True)[0])
  want = _flat(load_checkpoint(path, keep_packed=True)[0])
  for name in ("w1_packed", "w1_scale", "w2_packed", "w2_scale"):
    key = ("moe", "experts", name)
    array = got[key]
    assert array.sharding.is_equivalent_to(shardings[key], array.ndim), key
    for shard in array.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want[key])[shard.index])
  assert len({tuple((s.start, s.stop) for s in sh.index)
              for sh in got[CODES].addressable_shards}) > 1  # split, not replicated
