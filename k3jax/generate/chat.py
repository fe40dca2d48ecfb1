"""`--chat`: a user message rendered with the model folder's own chat template.

Minimal on purpose: the template is `chat_template` of the folder's `tokenizer_config.json`
(Jinja), rendered in a sandbox the way transformers' `apply_chat_template` renders it
(trim_blocks, lstrip_blocks, `raise_exception`, `tojson`, the special-token strings of the
config as variables, `add_generation_prompt=True`). The rendered text is then tokenized with
its special tokens recognised as such. Chat SFT (k3jax/tokenizer/chat.py) owns the full version
(roles, tools, assistant masks); generate needs one user turn.
"""

from __future__ import annotations

import json
import os

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3jax.errors import UserError

CONFIG = "tokenizer_config.json"


def find_tokenizer_config(folders) -> str | None:
  for folder in folders:
    if not folder:
      continue
    for candidate in (os.path.join(folder, CONFIG), os.path.join(folder, "hf", CONFIG)):
      if os.path.isfile(candidate):
        return candidate
  return None


def _token_text(value) -> str:
  if isinstance(value, dict):  # {"content": "...", ...} as transformers writes AddedToken
    return value.get("content", "")
  return value or ""


def render(config_path: str | None, messages: list[dict]) -> str:
  """The chat template of `config_path` applied to `messages`, ready for the assistant."""
  if config_path is None:
    raise UserError(f"--chat: the model folder has no {CONFIG} with a chat_template")
  with open(config_path, encoding="utf-8") as f:
    config = json.load(f)
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  if not template:
    raise UserError(f"--chat: {config_path} has no chat_template")

  def raise_exception(message):
    raise TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                 indent=indent)
  env.globals["raise_exception"] = raise_exception
  specials = {k: _token_text(config.get(k)) for k in
              ("bos_token", "eos_token", "pad_token", "unk_token")}
  try:
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            **specials)
  except TemplateError as e:
    raise UserError(f"--chat: the chat template failed: {e}") from None


def encode(tokenizer, text: str) -> list[int]:
  """Rendered chat text -> ids, with the template's special tokens as single tokens (the
  training tokenizer deliberately reads special-token text as plain text)."""
  enc = getattr(tokenizer, "_enc", None)
  if enc is not None:
    return [int(i) for i in enc.encode(text, allowed_special="all")]
  return [int(i) for i in tokenizer.encode(text)]
