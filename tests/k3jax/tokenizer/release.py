"""A small model folder shaped like the released K3 / K2 tokenizer files, built in the test:

    tiktoken.model          a BPE trained here on a mixed corpus (prose, code, digits, CJK,
                            emoji, whitespace): 256 byte tokens + MERGES merges
    tokenization_kimi.py    kimi_remote_code.py (transformers remote code over tiktoken)
    tokenizer_config.json   added_tokens_decoder with the release's special-token layout
                            (ids after the BPE: [BOS], [EOS], <|im_end|>, <|im_user|>, ...,
                            tool-call tokens, <|im_middle|>, <think>, [UNK], [PAD]), named
                            tokens, auto_map, and CHAT_TEMPLATE
    generation_config.json  eos_token_id: <|im_end|>

CHAT_TEMPLATE is written here in the release's shape (a tool_declare system turn with compact
JSON tools, a default system turn, role markers with <|im_middle|>, assistant reasoning shown
only after the last user turn, tool calls in a section, tool results as "## Return of <id>"),
in the plain `{% %}` style that relies on transformers' trim_blocks / lstrip_blocks.
"""

import base64
import json
import os
import shutil

MERGES = 200
# offsets from the first special id, as in the release's tokenizer_config.json
SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
# an added token that is not special and strips the whitespace around it (transformers'
# AddedToken lstrip / rstrip), to check k3jax splits text at added tokens the same way
STRIPPING = (40, "<|strip|>")

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- else -%}
    {%- for part in content -%}
      {%- if part.type == 'text' -%}
        {{- part.text -}}
      {%- else -%}
        {{- raise_exception('content parts must be text, not ' ~ part.type) -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{% set ns = namespace(last_user=-1) %}
{% for m in messages %}
  {% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{% endfor %}
{% if tools %}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{% endif %}
{% if messages[0].role != 'system' %}
<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>
{% endif %}
{% for m in messages %}
  {% if m.role == 'user' %}
<|im_user|>{{ m.name or 'user' }}<|im_middle|>{{ text(m.content) }}
  {%- elif m.role == 'system' %}
<|im_system|>{{ m.name or 'system' }}<|im_middle|>{{ text(m.content) }}
  {%- elif m.role == 'tool' %}
<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ text(m.content) }}
  {%- elif m.role == 'assistant' %}
<|im_assistant|>assistant<|im_middle|>
    {%- if m.reasoning_content is defined and loop.index0 > ns.last_user -%}
      <think>{{ m.reasoning_content }}</think>
    {%- else -%}
      <think></think>
    {%- endif -%}
    {%- if m.content is defined %}{{ text(m.content) }}{% endif -%}
    {%- if m.tool_calls %}
<|tool_calls_section_begin|>
      {% for call in m.tool_calls %}
<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>
        {%- if call.function.arguments is string -%}
          {{ call.function.arguments }}
        {%- else -%}
          {{ call.function.arguments | tojson }}
        {%- endif -%}
<|tool_call_end|>
      {% endfor %}
<|tool_calls_section_end|>
    {%- endif %}
  {%- else %}
{{ raise_exception('unknown role: ' ~ m.role) }}
  {%- endif -%}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_assistant|>assistant<|im_middle|>
{%- endif %}"""

# what the BPE is trained on: prose, code, digits, CJK, emoji, whitespace
CORPUS = """\
The quick brown fox jumps over the lazy dog. It's what they'll say; we've seen it, I'm sure.
def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text if c not in "\\t\\r\\n"]
Numbers: 3.14159 2718281828 1234567890 42 007 100000 and dates 2025-07-11.
中文分词测试：今天天气很好，我们去公园散步。机器学习模型需要大量的数据。
日本語のテキストも少し含めます。한국어 문장도 있습니다. Ünïcödé façade naïve café.
Emoji 🙂🚀 and symbols <> {} [] () => != == && || -> :: ... ### *** ---
    indented lines		with tabs
and   multiple   spaces



blank lines above. JSON: {"name": "get_weather", "arguments": {"city": "Paris"}}
"""


def train_ranks(pattern: str, merges: int = MERGES) -> list[bytes]:
  """Byte-pair merges learnt on CORPUS split by the remote code's pattern: each step merges the
  most frequent adjacent pair (ties: the smallest pair), as tiktoken's educational trainer
  does, but counting each distinct word once with its frequency (milliseconds, not seconds)."""
  import collections

  import regex

  words = collections.Counter(tuple(bytes([b]) for b in w.encode("utf-8"))
                              for w in regex.findall(pattern, CORPUS))
  ranks = [bytes([i]) for i in range(256)]
  for _ in range(merges):
    pairs = collections.Counter()
    for w, n in words.items():
      for pair in zip(w, w[1:]):
        pairs[pair] += n
    if not pairs:
      break
    best = min(pairs, key=lambda p: (-pairs[p], p))
    ranks.append(best[0] + best[1])
    merged = collections.Counter()
    for w, n in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == best:
          out.append(best[0] + best[1])
          i += 2
        else:
          out.append(w[i])
          i += 1
      merged[tuple(out)] += n
    words = merged
  return ranks


def build(folder) -> dict:
  """Write the folder; returns {token text: id} of its added tokens."""
  from k3jax.tokenizer.folder import read_pattern  # the file's pat_str, by ast
  os.makedirs(folder, exist_ok=True)
  shutil.copy(os.path.join(os.path.dirname(__file__), "kimi_remote_code.py"),
              os.path.join(folder, "tokenization_kimi.py"))
  ranks = train_ranks(read_pattern(folder))
  with open(os.path.join(folder, "tiktoken.model"), "w") as f:
    f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks))
  first = len(ranks)
  added = {first + k: (v, True) for k, v in SPECIALS.items()}
  added[first + STRIPPING[0]] = (STRIPPING[1], False)
  decoder = {str(i): {"content": text, "lstrip": not special, "normalized": False,
                      "rstrip": not special, "single_word": False, "special": special}
             for i, (text, special) in added.items()}
  config = {
      "added_tokens_decoder": decoder,
      "additional_special_tokens": [t for i, (t, s) in added.items() if s
                                    and t not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
      "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
      "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
      "chat_template": CHAT_TEMPLATE,
      "clean_up_tokenization_spaces": False,
      "model_max_length": 1048576,
      "tokenizer_class": "TikTokenTokenizer",
  }
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
  with open(os.path.join(folder, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": first + 2}, f)
  return {text: i for i, (text, _) in added.items()}
