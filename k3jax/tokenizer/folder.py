"""What a checkpoint folder says about its tokenizer, read without running any of its code.

A K2 / Kimi-Linear / K3 folder ships

    tiktoken.model          BPE ranks, one `base64(token_bytes) rank` line each
    tokenization_kimi.py    transformers remote code: a PreTrainedTokenizer wrapping tiktoken
                            (class attributes `pat_str`, `num_reserved_special_tokens`; the
                            long-text chunking constants; an `apply_chat_template` override)
    tokenizer_config.json   `added_tokens_decoder` {id: {content, lstrip, rstrip, ...}},
                            bos/eos/unk/pad tokens, `chat_template` (Jinja)
    chat_template.jinja     (optional) a template file; transformers prefers it to the config's
    generation_config.json  (optional) `eos_token_id`: the ids that end a generated turn

The remote code is parsed (`ast`), never imported: `trust_remote_code` would run arbitrary code
from a downloaded folder. What it contributes is data (a regex, counts, defaults) plus one known
transformation of `tools` before rendering (recursive key sort); an override that renders chats
some other way is refused by name rather than imitated.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os

from k3jax.errors import UserError

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_FILE = "generation_config.json"
# transformers' named special tokens, in the order its `special_tokens_map` lists them (the
# template sees these as variables: `{{ bos_token }}`)
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
# the release's long-text guards (tiktoken issue 195): text is encoded in chunks of at most
# MAX_CHARS characters, each cut so no run of whitespace / non-whitespace exceeds MAX_RUN
DEFAULT_MAX_CHARS = 400_000
DEFAULT_MAX_RUN = 25_000


@dataclasses.dataclass(frozen=True)
class AddedToken:
  """One entry of `added_tokens_decoder`."""
  content: str
  id: int
  special: bool = True
  lstrip: bool = False   # swallow the whitespace before it (transformers' AddedToken)
  rstrip: bool = False   # swallow the whitespace after it


@dataclasses.dataclass(frozen=True)
class RemoteCode:
  """What tokenization_*.py contributes (defaults where it says nothing)."""
  path: str | None
  pattern: str | None                  # pre-tokenisation regex (`pat_str`)
  num_reserved: int = 0                # ids len(ranks) .. + num_reserved are tiktoken specials
  max_chars: int = DEFAULT_MAX_CHARS
  max_run: int = DEFAULT_MAX_RUN
  init_defaults: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token=... defaults
  sorts_tools: bool = False            # apply_chat_template sorts tool dict keys recursively
  chat_override: str | None = None     # why its apply_chat_template cannot be followed, if so
  generation_prompt_default: bool = False  # its apply_chat_template's add_generation_prompt
                                       # default (K2's: True; transformers' own: False)


@dataclasses.dataclass(frozen=True)
class FolderSpec:
  """Everything k3jax needs from a checkpoint folder to tokenize and render chats."""
  folder: str
  ranks_file: str
  remote: RemoteCode
  added: tuple[AddedToken, ...]
  named: dict[str, str]                # bos_token -> "[BOS]", ... (only those set)
  chat_templates: dict[str, str]       # "default" (and named ones such as "tool_use")
  stop_ids: tuple[int, ...]            # generation_config eos_token_id (may be empty)


def find_tiktoken_file(folder: str | None) -> str | None:
  """`tiktoken.model` of an HF folder, or of a converted checkpoint (copied under `hf/`)."""
  if not folder or not os.path.isdir(folder):
    return None
  for candidate in (os.path.join(folder, TIKTOKEN_FILE),
                    os.path.join(folder, "hf", TIKTOKEN_FILE)):
    if os.path.isfile(candidate):
      return candidate
  return None


def _remote_files(folder: str) -> list[str]:
  return [os.path.join(folder, n) for n in sorted(os.listdir(folder))
          if n.startswith("tokenization") and n.endswith(".py")]


def _target_names(node: ast.Assign) -> set[str]:
  return {getattr(t, "id", getattr(t, "attr", None)) for t in node.targets}


def _literal(value: ast.expr):
  """A constant, or `"sep".join([...constants])` (how the release spells pat_str)."""
  if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
      and value.func.attr == "join" and isinstance(value.func.value, ast.Constant)):
    return value.func.value.value.join(ast.literal_eval(value.args[0]))
  return ast.literal_eval(value)


def read_pattern(folder: str) -> str:
  """The pre-tokenisation regex assigned to `pat_str` in tokenization_*.py next to the ranks."""
  remote = read_remote_code(folder)
  if remote.pattern is None:
    raise UserError(f"{folder}: has {TIKTOKEN_FILE} but no tokenization_*.py defining pat_str "
                    "(the BPE's pre-tokenisation regex); pass --tokenizer byte to train bytes")
  return remote.pattern


def read_remote_code(folder: str) -> RemoteCode:
  """Parse the first tokenization_*.py defining `pat_str` (RemoteCode(None, None) if none)."""
  for path in _remote_files(folder):
    with open(path, encoding="utf-8") as f:
      try:
        tree = ast.parse(f.read())
      except SyntaxError as e:
        raise UserError(f"{path}: not valid Python ({e.msg}, line {e.lineno})") from None
    values: dict[str, object] = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.Assign):
        for name in _target_names(node) & {"pat_str", "num_reserved_special_tokens",
                                           "TIKTOKEN_MAX_ENCODE_CHARS",
                                           "MAX_NO_WHITESPACES_CHARS"}:
          try:
            values.setdefault(name, _literal(node.value))
          except (ValueError, TypeError, SyntaxError, IndexError):
            raise UserError(f"{path}: {name} is not a literal k3jax can read") from None
    if "pat_str" not in values:
      continue
    sorts_tools, override, prompt_default = _chat_override(tree, path)
    return RemoteCode(
        path=path, pattern=values["pat_str"],
        num_reserved=int(values.get("num_reserved_special_tokens", 0)),
        max_chars=int(values.get("TIKTOKEN_MAX_ENCODE_CHARS", DEFAULT_MAX_CHARS)),
        max_run=int(values.get("MAX_NO_WHITESPACES_CHARS", DEFAULT_MAX_RUN)),
        init_defaults=_init_defaults(tree), sorts_tools=sorts_tools, chat_override=override,
        generation_prompt_default=prompt_default)
  return RemoteCode(path=None, pattern=None)


def _init_defaults(tree: ast.Module) -> dict[str, str]:
  """String defaults of `__init__(..., bos_token="[BOS]", ...)`: transformers uses them when
  tokenizer_config.json does not name the token."""
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef) and node.name == "__init__":
      args = node.args.args[len(node.args.args) - len(node.args.defaults):]
      pairs = list(zip(args, node.args.defaults))
      pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d]
      for arg, default in pairs:
        if arg.arg in NAMED_TOKENS and isinstance(default, ast.Constant) and isinstance(
            default.value, str):
          out[arg.arg] = default.value
  return out


def _chat_override(tree: ast.Module, path: str) -> tuple[bool, str | None, bool]:
  """(sorts tools, refusal reason, add_generation_prompt default) for the class's
  `apply_chat_template`, if it defines one.

  Followed: an override that hands the conversation to `super().apply_chat_template`, with
  `tools` passed through or through a module function that sorts keys (the K2 release does
  this so that tool schemas render in one canonical order). Anything else renders chats in its
  own Python and cannot be reproduced from the Jinja template."""
  functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
  for node in ast.walk(tree):
    if not (isinstance(node, ast.FunctionDef) and node.name == "apply_chat_template"):
      continue
    supers = [c for c in ast.walk(node) if isinstance(c, ast.Call)
              and isinstance(c.func, ast.Attribute) and c.func.attr == "apply_chat_template"
              and isinstance(c.func.value, ast.Call)
              and getattr(c.func.value.func, "id", None) == "super"]
    if not supers:
      return False, (f"{os.path.basename(path)} renders chats in its own Python code (its "
                     "apply_chat_template does not use the Jinja chat template)"), False
    args = node.args.args[len(node.args.args) - len(node.args.defaults):]
    pairs = list(zip(args, node.args.defaults)) + list(zip(node.args.kwonlyargs,
                                                           node.args.kw_defaults))
    prompt_default = any(a.arg == "add_generation_prompt" and isinstance(d, ast.Constant)
                         and d.value is True for a, d in pairs)
    transforms = set()
    for c in ast.walk(node):  # tools = f(tools), or super().apply_chat_template(tools=f(tools))
      if isinstance(c, ast.Assign) and "tools" in _target_names(c) and isinstance(
          c.value, ast.Call):
        transforms.add(getattr(c.value.func, "id", "?"))
      if isinstance(c, ast.keyword) and c.arg == "tools" and isinstance(c.value, ast.Call):
        transforms.add(getattr(c.value.func, "id", "?"))
    for name in transforms:
      fn = functions.get(name)
      if fn is None or not any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "sorted"
                               for c in ast.walk(fn)):
        return False, (f"{os.path.basename(path)} transforms tools with {name}() before "
                       "rendering, which k3jax does not know"), False
    return bool(transforms), None, prompt_default
  return False, None, False


def _added_tokens(config: dict, path: str) -> tuple[AddedToken, ...]:
  out = []
  for key, entry in config.get("added_tokens_decoder", {}).items():
    if not isinstance(entry, dict) or "content" not in entry or not str(key).isdigit():
      raise UserError(f"{path}: added_tokens_decoder[{key!r}] is not {{id: {{content: ...}}}}")
    if entry.get("single_word"):
      raise UserError(f"{path}: added token {entry['content']!r} has single_word=true, which "
                      "k3jax does not implement")
    out.append(AddedToken(entry["content"], int(key), bool(entry.get("special", True)),
                          bool(entry.get("lstrip", False)), bool(entry.get("rstrip", False))))
  return tuple(sorted(out, key=lambda t: t.id))


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # a serialised AddedToken
    return value.get("content")
  return value if isinstance(value, str) else None


def _templates(folder: str, config: dict, path: str) -> dict[str, str]:
  """transformers' precedence: chat_template.jinja over the config's `chat_template`, which is
  a string or a list of {name, template}."""
  jinja = os.path.join(folder, TEMPLATE_FILE)
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return {"default": f.read()}
  value = config.get("chat_template")
  if value is None:
    return {}
  if isinstance(value, str):
    return {"default": value}
  if isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys()
                                     for t in value):
    return {t["name"]: t["template"] for t in value}
  raise UserError(f"{path}: chat_template is neither a string nor a list of {{name, template}}")


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
  if not isinstance(value, dict):
    raise UserError(f"{path}: expected a JSON object")
  return value


def read_folder(ranks_file: str) -> FolderSpec:
  """The tokenizer description of the folder holding `ranks_file` (a tiktoken.model)."""
  folder = os.path.dirname(ranks_file)
  remote = read_remote_code(folder)
  config_path = os.path.join(folder, CONFIG_FILE)
  config = _read_json(config_path)
  named = {}
  for name in NAMED_TOKENS:
    text = _token_text(config.get(name)) if name in config else remote.init_defaults.get(name)
    if text is not None:
      named[name] = text
  stop = _read_json(os.path.join(folder, GENERATION_FILE)).get("eos_token_id", [])
  stop = [stop] if isinstance(stop, int) else stop
  if not (isinstance(stop, list) and all(isinstance(i, int) for i in stop)):
    raise UserError(f"{folder}/{GENERATION_FILE}: eos_token_id is not an id or a list of ids")
  return FolderSpec(folder=folder, ranks_file=ranks_file, remote=remote,
                    added=_added_tokens(config, config_path), named=named,
                    chat_templates=_templates(folder, config, config_path),
                    stop_ids=tuple(stop))
