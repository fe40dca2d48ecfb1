"""The README's commands work as written: every command of its ```-fenced shell blocks runs
verbatim, in order, from a fresh working directory (relative paths, as a new user types
them), with only its step counts made small (`SMALL`: the flag stays, its count changes).

Every command is run or skipped by an explicit rule: `SKIP` (installing, and the test suite
itself) or `PROGRAMS` / `PYTHONS` (`k3jax` and `python -m k3jax...`, run with this
interpreter on this checkout). A command that no rule covers fails the test, so a new README
command is classified here, never dropped unnoticed.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
SHELL_TAGS = ("", "sh", "bash", "shell", "console")  # fences whose lines are commands
CLI = [sys.executable, "-m", "k3jax.cli"]

# Not run, by their leading words: they set up the environment this test already runs in.
SKIP = {
    ("python3", "-m", "venv"): "creates the virtual environment",
    (".venv/bin/pip", "install"): "installs k3jax and its dependencies",
    (".venv/bin/pip", "uninstall"): "adjusts the installed packages",
    (".venv/bin/python", "-m", "pytest"): "the test suite itself",
}
# README program -> what runs it here
PROGRAMS = {"k3jax": CLI, ".venv/bin/k3jax": CLI}
# `PYTHON -m k3jax...` runs with this interpreter
PYTHONS = ("python", "python3", ".venv/bin/python")
# flag -> the small value it takes here (a README count meant for a real run)
SMALL = {"--steps": "4", "--max-new-tokens": "8"}
SEPARATORS = ("&&", ";")
UNSUPPORTED = ("|", "||", "&", ">", ">>", "<", "(", ")")


def shell_blocks(text: str) -> list[str]:
  """The bodies of the ```-fenced blocks whose info string is empty or a shell."""
  fences = re.finditer(r"^```[ \t]*([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", text,
                       re.MULTILINE | re.DOTALL)
  return [m.group(2) for m in fences if m.group(1).lower() in SHELL_TAGS]


def commands(block: str) -> list[list[str]]:
  """The commands of a shell block: lines (backslash continuations joined), a leading `$ `
  prompt and comments dropped, split at `&&` and `;`."""
  out = []
  for line in block.replace("\\\n", " ").splitlines():
    line = line.strip().removeprefix("$ ")
    if not line or line.startswith("#"):
      continue
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, ""
    words: list[str] = []
    for token in [*lex, ";"]:
      if token in UNSUPPORTED:
        raise AssertionError(f"README command {line!r}: {token!r} is not supported here")
      if token in SEPARATORS:
        if words:
          out.append(words)
        words = []
      else:
        words.append(token)
  return out


def skipped(words: list[str]) -> str | None:
  for prefix, why in SKIP.items():
    if tuple(words[:len(prefix)]) == prefix:
      return why
  return None


def small(args: list[str]) -> list[str]:
  """`args` with each `SMALL` flag's value replaced (`--flag N` and `--flag=N`)."""
  out = list(args)
  for i, arg in enumerate(args):
    flag, eq, _ = arg.partition("=")
    if eq and flag in SMALL:
      out[i] = f"{flag}={SMALL[flag]}"
    elif arg in SMALL and i + 1 < len(args):
      out[i + 1] = SMALL[arg]
  return out


def to_run(words: list[str]) -> list[str]:
  """The argv that runs README command `words` here; AssertionError if no rule covers it."""
  if words[0] in PROGRAMS:
    return [*PROGRAMS[words[0]], *small(words[1:])]
  if words[0] in PYTHONS and len(words) > 2 and words[1] == "-m" and (
      words[2] == "k3jax" or words[2].startswith("k3jax.")):
    return [sys.executable, "-m", *small(words[2:])]
  raise AssertionError(f"README command {shlex.join(words)!r} is neither run nor skipped: "
                       "add a rule for it to tests/test_readme.py")


def readme_plan(text: str) -> list[tuple[list[str], list[str] | None, str | None]]:
  """(README command, argv to run or None, why it is skipped or None), in README order."""
  plan = []
  for block in shell_blocks(text):
    for words in commands(block):
      why = skipped(words)
      plan.append((words, None, why) if why else (words, to_run(words), None))
  return plan


def test_the_plan_of_a_readme():
  """The parser and the rules, on a README of every kind of line."""
  text = "\n".join([
      "Set up:", "```", ("python3 -m venv .venv && .venv/bin/pip install -e . && "
                         ".venv/bin/k3jax train --config tiny --steps 300 --out runs/tiny"),
      "```",
      "```python", "print('not a shell block')", "```",
      "```bash", "# a comment", "$ k3jax generate runs/tiny --prompt \"def \" \\",
      "    --max-new-tokens=200; .venv/bin/python -m k3jax.train.memory --config k3", "```",
      "```", ".venv/bin/python -m pytest -n 2 -q", "```"])
  plan = readme_plan(text)
  assert [(shlex.join(w), run, why is not None) for w, run, why in plan] == [
      ("python3 -m venv .venv", None, True),
      (".venv/bin/pip install -e .", None, True),
      (".venv/bin/k3jax train --config tiny --steps 300 --out runs/tiny",
       [*CLI, "train", "--config", "tiny", "--steps", "4", "--out", "runs/tiny"], False),
      ("k3jax generate runs/tiny --prompt 'def ' --max-new-tokens=200",
       [*CLI, "generate", "runs/tiny", "--prompt", "def ", "--max-new-tokens=8"], False),
      (".venv/bin/python -m k3jax.train.memory --config k3",
       [sys.executable, "-m", "k3jax.train.memory", "--config", "k3"], False),
      (".venv/bin/python -m pytest -n 2 -q", None, True)]
  with pytest.raises(AssertionError, match="neither run nor skipped"):
    readme_plan("```\ncurl https://example.com/install.sh\n```\n")
  with pytest.raises(AssertionError, match="not supported"):
    readme_plan("```\nk3jax info --config tiny | head\n```\n")


@pytest.mark.long
def test_readme_commands_run_as_written(tmp_path):
  with open(README) as f:
    plan = readme_plan(f.read())
  run = [(words, argv) for words, argv, _ in plan if argv is not None]
  assert run, "the README shows no k3jax command to run"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
  for words, argv in run:
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, (f"README command {shlex.join(words)!r} (run as "
                                  f"{shlex.join(argv)}) exited {proc.returncode}:\n"
                                  f"{proc.stderr[-3000:]}")
