"""Moonshot's real K2-family tokenizer files, read in place from the shared reference folder
(kimi_tokenizer/: tiktoken.model, K2-Instruct's tokenizer_config.json with its tool-call
template, K2-Thinking's chat_template.jinja; its README says where each comes from), assembled
into release-shaped folders in a temporary directory.

The data files are linked, never copied. The release's `tokenization_kimi.py` is code and is
not kept there; the folder gets the tests' remote code (kimi_remote_code.py) with the release's
pre-tokenisation regex and long-run guard, which is all k3jax reads from that file (by ast) and
what transformers runs (trust_remote_code) for the comparison.
"""

import os
import re

KIMI = "kimi_tokenizer"
# the release's pat_str, as its tokenization_kimi.py writes it
K2_PATTERN = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
RELEASE_MAX_RUN = 25_000


def remote_code() -> str:
  """kimi_remote_code.py with the release's regex and guard."""
  with open(os.path.join(os.path.dirname(__file__), "kimi_remote_code.py")) as f:
    source = f.read()
  pattern = "pat_str = \"|\".join([\n" + "".join(f"      {p!r},\n" for p in K2_PATTERN) + "  ])"
  source, n = re.subn(r"pat_str = \"\|\"\.join\(\[.*?\n  \]\)", lambda _: pattern, source,
                      flags=re.S)
  assert n == 1
  source, n = re.subn(r"MAX_NO_WHITESPACES_CHARS = [\d_]+", f"MAX_NO_WHITESPACES_CHARS = "
                      f"{RELEASE_MAX_RUN}", source)
  assert n == 1
  return source


def assemble(dest: str, reference_dir: str, *, thinking: bool = False) -> str:
  """A K2-Instruct folder (thinking: with K2-Thinking's chat_template.jinja, which transformers
  and k3jax prefer to the config's template) at `dest`."""
  src = os.path.join(reference_dir, KIMI)
  os.makedirs(dest, exist_ok=True)
  files = {"tiktoken.model": "tiktoken.model", "tokenizer_config.json": "tokenizer_config.json"}
  if thinking:
    files["chat_template.jinja"] = os.path.join("variants", "k2-thinking", "chat_template.jinja")
  for name, rel in files.items():
    os.symlink(os.path.join(src, rel), os.path.join(dest, name))
  with open(os.path.join(dest, "tokenization_kimi.py"), "w") as f:
    f.write(remote_code())
  return dest
