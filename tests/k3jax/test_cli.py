"""`k3jax --help` lists exactly the commands that run, and the README lists the same ones."""

import argparse
import os
import re

import pytest

from k3jax import cli
from k3jax.commands import train as train_command
from k3jax.train import loop as train_loop

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def commands():
  parser = cli.build_parser()
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return set(sub.choices)


def test_help_lists_the_readme_commands():
  with open(README) as f:
    text = f.read()
  section = text[text.index("## Commands"):text.index("\n## ", text.index("## Commands") + 1)]
  documented = set(re.findall(r"^- `k3jax ([\w-]+)", section, flags=re.M))
  assert commands() == documented == {"info", "prepare-data", "train", "rl", "generate",
                                      "serve", "eval", "convert", "export", "parity",
                                      "tokenize", "plan"}


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


def test_train_takes_the_step_knobs_plan_searches():
  """`k3jax plan` prints its settings as `k3jax train` flags: --remat, --loss-chunk,
  --attention and --capacity-factor reach the run's Execution; none given (or 0) keeps the
  defaults (whole logits, dense attention, dropless experts); a negative value is refused."""
  base = ["train", "--out", "o", "--config", "tiny"]
  args = cli.build_parser().parse_args(base + ["--remat", "full", "--loss-chunk", "64",
                                               "--attention", "flash", "--capacity-factor",
                                               "1.25"])
  ex = train_loop.execution(train_command.options_from_args(args))
  assert (ex.remat.value, ex.loss_chunk, ex.attention.value, ex.moe_capacity_factor) == (
      "full", 64, "flash", 1.25)
  ex = train_loop.execution(train_command.options_from_args(cli.build_parser().parse_args(base)))
  assert (ex.remat.value, ex.loss_chunk, ex.attention.value, ex.moe_capacity_factor) == (
      "none", None, "dense", None)
  # 0 says the default out loud (the plan prints no flag for it): whole logits, dropless
  zero = cli.build_parser().parse_args(base + ["--loss-chunk", "0", "--capacity-factor", "0"])
  ex = train_loop.execution(train_command.options_from_args(zero))
  assert (ex.loss_chunk, ex.moe_capacity_factor) == (None, None)
  for flag, value in (("--loss-chunk", "-1"), ("--capacity-factor", "-1")):
    with pytest.raises(SystemExit):  # argparse: one line naming the flag, exit 2
      cli.build_parser().parse_args(base + [flag, value])
