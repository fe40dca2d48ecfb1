"""`k3jax --help` lists exactly the commands that run, and the README lists the same ones."""

import argparse
import os
import re

import pytest

from k3jax import cli

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def commands():
  parser = cli.build_parser()
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return set(sub.choices)


def test_help_lists_the_readme_commands():
  with open(README) as f:
    text = f.read()
  section = text[text.index("## Commands"):text.index("\n## ", text.index("## Commands") + 1)]
  documented = set(re.findall(r"^- `k3jax (\w+)", section, flags=re.M))
  assert commands() == documented == {"info", "train", "rl", "generate", "serve", "eval",
                                      "convert", "export", "parity", "tokenize", "plan"}


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_command_has_help(command, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main([command, "--help"])
  assert e.value.code == 0
  assert capsys.readouterr().out.startswith(f"usage: k3jax {command}")


def test_rl_takes_the_optimizer_flags_as_train_spells_them():
  base = ["rl", "--init-from", "m", "--data", "d.jsonl", "--reward", "exact", "--group-size",
          "4", "--steps", "2", "--out", "o"]
  train = cli.build_parser().parse_args(base + ["--lr", "3e-3", "--adam-lr", "1e-4", "--warmup",
                                                "5", "--clip", "none"])
  long = cli.build_parser().parse_args(base + [
      "--learning-rate", "3e-3", "--adam-learning-rate", "1e-4", "--warmup-steps", "5",
      "--clip-norm", "none"])
  for args in (train, long):
    assert (args.learning_rate, args.adam_learning_rate, args.warmup_steps, args.clip_norm) == (
        3e-3, 1e-4, 5, None)
