"""HF -> k3jax (Orbax) -> HF on the official-layout tiny checkpoint (no forward passes here;
the logits are checked in test_parity_cli.py).

- `--experts mxfp4`: the exported folder is the source folder, file for file, byte for byte.
- bf16 experts: the same names, dtypes, shapes and index; every non-expert tensor bytewise
  equal; the experts equal in value (re-quantised codes may spell a value differently).
- The checkpoint restores with the standard Orbax API into the model's own abstract state.
- A checkpoint without a manifest (as training saves it, OCDBT) exports to the official
  layout from the name map alone: checked tensor by tensor against the official files.
"""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors import safe_open

from convert.hf_load import load_model
from convert.load import load_checkpoint
from k3jax.cli import main
from pallas_kernels import mxfp4
from tests.runs import fake_run

FILES = ("config.json", "model.safetensors.index.json", "model-00001-of-00003.safetensors",
         "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors")


@pytest.fixture(scope="module")
def hf_dir(reference_dir):
  return os.path.join(reference_dir, "k3_tiny_a")


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
  root = tmp_path_factory.mktemp("roundtrip")
  out = {}
  for experts in ("mxfp4", "bf16"):
    ckpt, back = str(root / f"ckpt_{experts}"), str(root / f"back_{experts}")
    assert main(["convert", hf_dir, ckpt, "--experts", experts, "--quiet"]) == 0
    assert main(["export", ckpt, back, "--quiet"]) == 0
    out[experts] = (ckpt, back)
  return out


def _tensors(folder):
  out = {}
  for f in sorted(os.listdir(folder)):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(folder, f), "numpy") as h:
        for k in h.keys():
          sl = h.get_slice(k)
          out[k] = (f, sl.get_dtype(), tuple(sl.get_shape()), h.get_tensor(k))
  return out


def test_mxfp4_round_trip_is_byte_identical(hf_dir, converted):
  _, back = converted["mxfp4"]
  want, got = _tensors(hf_dir), _tensors(back)
  assert list(got) == list(want)
  for name, (file, dtype, shape, value) in want.items():
    g = got[name]
    assert (g[0], g[1], g[2]) == (file, dtype, shape), name
    assert g[3].tobytes() == value.tobytes(), name
  for f in FILES:  # whole files: header order, metadata, padding and the index too
    with open(os.path.join(hf_dir, f), "rb") as a, open(os.path.join(back, f), "rb") as b:
      assert a.read() == b.read(), f


def test_bf16_round_trip_is_equal_in_value(hf_dir, converted):
  _, back = converted["bf16"]
  want, got = _tensors(hf_dir), _tensors(back)
  assert [(k, v[:3]) for k, v in got.items()] == [(k, v[:3]) for k, v in want.items()]
  for name, (_, _, _, value) in want.items():
    if name.endswith("weight_packed"):
      scale = name.replace("weight_packed", "weight_scale")
      np.testing.assert_array_equal(mxfp4.dequantize_np(got[name][3], got[scale][3]),
                                    mxfp4.dequantize_np(value, want[scale][3]), err_msg=name)
    elif not name.endswith("weight_scale"):
      assert got[name][3].tobytes() == value.tobytes(), name
  for f in ("config.json", "model.safetensors.index.json"):
    with open(os.path.join(hf_dir, f), "rb") as a, open(os.path.join(back, f), "rb") as b:
      assert a.read() == b.read(), f


def _flat(model):
  return {tuple(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def direct(hf_dir):
  return _flat(load_model(hf_dir)[0])


def test_standard_orbax_restore(converted, direct):
  """`ocp.StandardCheckpointer().restore(path, abstract_state)` is all a user needs."""
  import configs
  from k3jax.model.transformer import K3Model
  ckpt, _ = converted["bf16"]
  cfg = configs.resolve(ckpt)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
  state = ocp.StandardCheckpointer().restore(ckpt, abstract)
  got = _flat(nnx.merge(graphdef, state))
  assert set(got) == set(direct)
  for k, v in direct.items():
    np.testing.assert_array_equal(got[k], v, err_msg=".".join(k))


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_load_checkpoint_gives_the_folder_weights(converted, direct, experts):
  model, cfg = load_checkpoint(converted[experts][0])
  got = _flat(model)
  for k, v in direct.items():
    np.testing.assert_array_equal(got[k], v, err_msg=".".join(k))


def test_config_files_written_before_the_execution_split_load_unchanged(converted, direct,
                                                                       tmp_path):
  """A k3jax_config.json written before architecture and execution were separated holds the
  execution fields inside "config": the checkpoint loads the same config and weights, and the
  dtypes a `k3jax train` output of that time recorded there are the ones it loads in."""
  import configs
  from k3jax.execution import Execution
  ckpt = converted["bf16"][0]
  legacy = tmp_path / "legacy"
  shutil.copytree(ckpt, legacy)
  path = legacy / "k3jax_config.json"
  raw = json.loads(path.read_text())
  raw["config"].update(dtype="float32", param_dtype="float32", matmul_precision="default",
                       kda_backend=None, moe_grouped_matmul=None, moe_capacity_factor=None,
                       moe_dispatch=None, remat="none", loss_chunk=None, attention="dense",
                       attention_block=512, scan_layers=True)
  path.write_text(json.dumps(raw))
  model, cfg = load_checkpoint(str(legacy))
  assert cfg == configs.resolve(ckpt) and model.ex == Execution()
  got = _flat(model)
  for k, v in direct.items():
    np.testing.assert_array_equal(got[k], v, err_msg=".".join(k))
  raw["config"].update(dtype="bfloat16", param_dtype="bfloat16", remat=False)
  path.write_text(json.dumps(raw))
  model, cfg = load_checkpoint(str(legacy))
  assert cfg == configs.resolve(ckpt)
  assert model.ex == Execution(dtype="bfloat16", param_dtype="bfloat16")
  assert model.embed[...].dtype == ml_dtypes.bfloat16


def test_partial_conversion_records_its_layers(hf_dir, tmp_path):
  out = str(tmp_path / "part")
  assert main(["convert", hf_dir, out, "--layers", "3-4", "--quiet"]) == 0
  with open(os.path.join(out, "k3jax_convert.json")) as f:
    manifest = json.load(f)
  assert manifest["layers"] == [3, 4] and not manifest["embedding"] and not manifest["head"]
  assert main(["export", out, str(tmp_path / "back"), "--quiet"]) == 2
  assert not os.path.exists(tmp_path / "back")


def test_fresh_layout_from_a_trained_checkpoint(hf_dir, converted, tmp_path):
  """A checkpoint Orbax saved itself (OCDBT, float32 params, no manifest) exports to the
  official layout: the official names, dtypes and shapes, contiguous layers per shard, and the
  official values (bf16 exactly, experts equal after MXFP4)."""
  import configs
  from k3jax.model.transformer import K3Model
  ckpt = converted["bf16"][0]
  model, cfg = load_checkpoint(ckpt)  # float32 parameters
  trained = tmp_path / "trained"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(str(trained), nnx.state(model))
  checkpointer.wait_until_finished()
  shutil.copy(os.path.join(ckpt, "k3jax_config.json"), trained)
  assert configs.resolve(str(trained)) == cfg
  del K3Model
  out = str(tmp_path / "exported")
  assert main(["export", str(trained), out, "--num-shards", "3", "--quiet"]) == 0
  want, got = _tensors(hf_dir), _tensors(out)
  assert sorted(got) == sorted(want)
  shard_of_layer = {}
  for name, (_file, dtype, shape, value) in want.items():
    g = got[name]
    assert (g[1], g[2]) == (dtype, shape), name
    if name.endswith("weight_packed"):
      scale = name.replace("weight_packed", "weight_scale")
      np.testing.assert_array_equal(mxfp4.dequantize_np(g[3], got[scale][3]),
                                    mxfp4.dequantize_np(value, want[scale][3]), err_msg=name)
    elif not name.endswith("weight_scale"):
      assert g[3].tobytes() == value.tobytes(), name
    parts = name.split(".")
    if "layers" in parts:
      layer = int(parts[parts.index("layers") + 1])
      assert shard_of_layer.setdefault(layer, g[0]) == g[0], f"layer {layer} is split"
  shards = sorted(set(shard_of_layer.values()))
  assert len(shards) == 3
  assert [shard_of_layer[l] for l in sorted(shard_of_layer)] == sorted(shard_of_layer.values())
  assert got["language_model.model.embed_tokens.weight"][0] == shards[0]
  for head in ("language_model.lm_head.weight", "language_model.model.norm.weight",
               "language_model.model.output_attn_res_proj.weight"):
    assert got[head][0] == shards[-1]
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    index = json.load(f)
  assert index["metadata"]["total_size"] == sum(v[3].nbytes for v in got.values())
  from k3jax.hf_config import from_hf_config
  assert from_hf_config(out) == from_hf_config(hf_dir)


def test_vision_tensors_are_skipped_unread(hf_dir, tmp_path):
  """Vision shards are never opened: here the one the index names is not even a valid file."""
  folder = tmp_path / "hf"
  shutil.copytree(hf_dir, folder, ignore=shutil.ignore_patterns("*.npz"))
  os.chmod(folder, 0o755)
  index_path = folder / "model.safetensors.index.json"
  os.chmod(index_path, 0o644)
  index = json.loads(index_path.read_text())
  index["weight_map"]["vision_tower.blocks.0.attn.qkv.weight"] = "model-vision.safetensors"
  index["weight_map"]["mm_projector.proj.weight"] = "model-vision.safetensors"
  index_path.write_text(json.dumps(index))
  (folder / "model-vision.safetensors").write_bytes(b"not a safetensors file")
  out = str(tmp_path / "ckpt")
  assert main(["convert", str(folder), out, "--quiet"]) == 0
  with open(os.path.join(out, "k3jax_convert.json")) as f:
    shards = [s["file"] for s in json.load(f)["source"]["shards"]]
  assert shards == list(FILES[2:])


def test_prefix_of_a_partial_download(hf_dir, tmp_path):
  """The first two shards only (layers 0-5, the embedding): `--layers 0-3` converts."""
  folder = tmp_path / "hf"
  shutil.copytree(hf_dir, folder, ignore=shutil.ignore_patterns("*.npz", FILES[-1]))
  out = str(tmp_path / "ckpt")
  assert main(["convert", str(folder), out, "--layers", "0-3", "--quiet"]) == 0
  assert main(["convert", str(folder), str(tmp_path / "all"), "--quiet"]) == 2
  model, cfg = load_checkpoint(out, allow_partial=True)
  assert cfg.num_layers == 4 and cfg.mla_layers == (3,)
  with pytest.raises(Exception, match="holds layers 0-3"):
    load_checkpoint(out)


def test_relative_paths_and_a_train_output(hf_dir, tmp_path, monkeypatch):
  """convert and export by paths relative to the working directory (Orbax itself takes only
  absolute ones); export also takes a `k3jax train` output folder (run.json + model/) for its
  model/: the source folder comes back byte for byte."""
  monkeypatch.chdir(tmp_path)
  assert main(["convert", os.path.relpath(hf_dir), "ckpt", "--experts", "mxfp4",
               "--quiet"]) == 0
  fake_run("run", model="ckpt")
  for source, back in (("ckpt", "back"), ("run", "back_run"), ("run/model", "back_model")):
    assert main(["export", source, back, "--quiet"]) == 0, source
    for name in FILES:
      with open(os.path.join(hf_dir, name), "rb") as a, open(os.path.join(back, name), "rb") as b:
        assert a.read() == b.read(), (source, name)
