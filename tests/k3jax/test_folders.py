"""k3jax/folders.py: the folder a user names as a model, resolved to its weights and tokenizer;
relative paths come back absolute, taken from the working directory."""

import json
import os

import pytest

import configs
from k3jax import cli
from k3jax.errors import UserError
from k3jax.folders import (
  TokenizerSource,
  absolute,
  absolute_tokenizer,
  model_folder,
  tokenizer_source,
)
from tests.runs import fake_run


def test_a_plain_folder_is_itself_with_its_own_tokenizer(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  os.makedirs("hf")
  got = model_folder("hf")
  assert got.weights == str(tmp_path / "hf") and got.run is None
  assert got.tokenizer == TokenizerSource("auto", str(tmp_path / "hf"))
  assert model_folder("missing").weights == str(tmp_path / "missing")  # the caller refuses it


def test_a_train_output_is_its_model_with_the_runs_tokenizer(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  os.makedirs("hf")
  fake_run("byte_run", tokenizer="byte")
  fake_run("scratch")                                       # auto, no --init-from: bytes
  fake_run("ft", init_from="hf")                            # auto: the init folder's own
  fake_run("ft_of_ft", init_from=str(tmp_path / "ft"))      # auto through a run: its own
  fake_run("ft_of_bytes", init_from="byte_run")
  fake_run("tik", tokenizer="tiktoken", init_from="ft")
  fake_run("named", tokenizer="hf", init_from="byte_run")   # --tokenizer FOLDER
  want = {"byte_run": ("byte", None), "scratch": ("auto", None),
          "ft": ("auto", "hf"), "ft_of_ft": ("auto", "hf"), "ft_of_bytes": ("byte", None),
          "tik": ("tiktoken", "hf"), "named": (str(tmp_path / "hf"), "hf")}
  for run, (kind, folder) in want.items():
    got = model_folder(run)
    assert got.weights == str(tmp_path / run / "model") and got.run == str(tmp_path / run)
    assert got.tokenizer == TokenizerSource(kind, folder and str(tmp_path / folder)), run
  # a run folder also where a folder's weights are taken as --tokenizer or --init-from
  assert tokenizer_source("auto", "ft") == TokenizerSource("auto", str(tmp_path / "hf"))
  assert tokenizer_source("ft_of_bytes", None) == TokenizerSource("byte", None)


def test_run_folders_that_loop_or_refuse(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  fake_run("self", init_from="self")  # `--init-from X --out X`: X's own files before
  assert model_folder("self").tokenizer == TokenizerSource("auto", str(tmp_path / "self"))
  fake_run("a", init_from="b", tokenizer="tiktoken")
  fake_run("b", init_from="a")
  assert model_folder("a").tokenizer == TokenizerSource("tiktoken", str(tmp_path / "a"))
  fake_run("broken")
  (tmp_path / "broken" / "run.json").write_text("{not json")
  with pytest.raises(UserError, match="run.json: unreadable"):
    model_folder("broken")
  os.makedirs("no_model")
  (tmp_path / "no_model" / "run.json").write_text("{}")     # a run that has not finished
  assert model_folder("no_model").weights == str(tmp_path / "no_model")


def test_options_as_a_run_records_them(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert absolute(None) is None and absolute("data.txt") == str(tmp_path / "data.txt")
  assert [absolute_tokenizer(k) for k in ("auto", "byte", "tiktoken")] == [
      "auto", "byte", "tiktoken"]
  assert absolute_tokenizer("hf") == str(tmp_path / "hf")


def test_info_takes_a_train_output_by_a_relative_path(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  fake_run("runs/tiny")
  with open("runs/tiny/model/k3jax_config.json", "w") as f:
    json.dump({"format": "k3jax", "config": configs.get("tiny").to_dict()}, f)
  got = {}
  for name in ("tiny", "runs/tiny", "runs/tiny/model"):
    assert cli.main(["info", "--config", name, "--json"]) == 0
    got[name] = json.loads(capsys.readouterr().out)
    assert got[name].pop("config") == name
  assert got["runs/tiny"] == got["runs/tiny/model"] == got["tiny"]
