"""k3jax's tokenizer and chat rendering against transformers loading the same synthetic folder
(`AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`, everything local): ids of
tricky strings, special tokens, decoding, the long-text guards, rendered conversations and
their ids, and the Jinja environment's specifics one by one.

transformers' import dominates this file's time, so one folder and one AutoTokenizer serve
every test here."""

import jinja2
import numpy as np
import pytest

from k3jax.tokenizer import chat, load_tokenizer

from . import conversations, release


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("k3_tokenizer")
  added = release.build(str(path))
  return str(path), added


@pytest.fixture(scope="module")
def pair(folder):
  from transformers import AutoTokenizer  # slow import: once per module
  return load_tokenizer("auto", folder[0]), AutoTokenizer.from_pretrained(
      folder[0], trust_remote_code=True, local_files_only=True)


def tricky_strings(added):
  first = min(added.values())
  return [
      "", "hello", "  leading and trailing  ", "It's they'll WE'VE i'M",
      # special-token text, whole, partial, nested, adjacent, unknown, a reserved slot
      "user text with <|im_end|> inside", "<|im_user|>user<|im_middle|>fake turn<|im_end|>",
      "[BOS][EOS][PAD]", "<think>x</think>", "<|im_end", "<|im_end|<|im_end|>>",
      f"<|reserved_token_{first + 5}|>", "<|reserved_token_99999|>", "[bos] <|IM_END|>",
      # an added token that strips the whitespace around it
      "a  <|strip|>  b", "<|strip|>", "  <|strip|>\n\n<|strip|>  ",
      # unicode, emoji, CJK, right-to-left, combining marks
      "Ünïcödé façade naïve café e\u0301", "مرحبا بالعالم", "🙂🚀👩‍👩‍👧‍👦 flags 🇫🇷",
      "hello 👋🏽 world", "中文分词测试：今天天气很好", "日本語とEnglishのmix한국어",
      # whitespace runs, newlines, control characters, line separators
      "\t\t\n\n  \r\n", " " * 50, "a" + " " * 2500 + "b", "\n" * 1500, "x\u2028y\u2029z",
      "\x00\x1f\x7f end", "\r\n\r\n\r\n", " \n \n \n",
      # digit runs
      "1234567890123", "3.14159", "1,000,000", "٣٤٥٦٧", "v1.2.3-rc4",
      # code, and runs longer than the remote code's 1000-character guard
      "def f(x):\n    return x**2  # comment\n", "x" * 2500, "x" + "in" * 1300, "中" * 1200,
  ]


def test_ids_match_transformers_on_tricky_strings(pair, folder):
  ours, hf = pair
  for text in tricky_strings(folder[1]):
    want = hf(text, add_special_tokens=False)["input_ids"]  # the path apply_chat_template uses
    assert ours.encode(text).tolist() == want, repr(text)
    if "<|strip|>" not in text:  # the remote code's own encode has no added-token stripping
      assert hf.encode(text) == want, repr(text)
    # a training document: special-token text stays text
    assert ours.encode(text, allow_special=False).tolist() == hf.encode(
        text, allow_special_tokens=False), repr(text)


def test_special_tokens_and_decoding_match_transformers(pair, folder):
  ours, hf = pair
  added = folder[1]
  assert ours.vocab_size == len(hf) == min(added.values()) + 256
  for text, token in added.items():
    assert ours.token_id(text) == hf.convert_tokens_to_ids(text) == token
  assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id)
  assert ours.stop_ids == (added["<|im_end|>"],)  # generation_config.json
  for text in tricky_strings(added):
    ids = ours.encode(text).tolist()
    assert ours.decode(ids) == hf.decode(ids), repr(text)
    if "<|strip|>" not in text:
      assert ours.decode(ids) == text, repr(text)
    assert ours.decode_bytes(ids).decode("utf-8") == hf.decode(ids), repr(text)


def test_long_run_guard_comes_from_the_remote_code_and_changes_ids(pair):
  """The remote code cuts runs longer than its MAX_NO_WHITESPACES_CHARS (1000 in the test
  folder, 25000 in the release); k3jax reads the constant, and the cut changes the ids (so the
  matches above are not vacuous)."""
  ours, hf = pair
  assert ours.spec.remote.max_run == 1000
  text = "x" + "in" * 1300  # the cut at 1000 characters falls inside a merged "in"
  plain = ours._enc.encode(text, allowed_special="all")
  assert ours.encode(text).tolist() == hf.encode(text) != plain


def test_conversations_render_and_encode_as_transformers(pair):
  ours, hf = pair
  for name, (messages, tools) in conversations.CONVERSATIONS.items():
    for prompt in (False, True):
      want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt,
                                    tokenize=False)
      assert ours.render_chat(messages, tools, add_generation_prompt=prompt) == want, name
      ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt,
                                   tokenize=True)["input_ids"]
      assert ours.encode_chat(messages, tools, add_generation_prompt=prompt).tolist() == ids
  # the remote code sorts tool schemas' keys: the rendering shows it
  text = ours.render_chat(*conversations.CONVERSATIONS["tools"])
  assert '{"function":{"description":"The time <now> & here","name":"now"' in text


# (template, messages): each exercises one specific of transformers' Jinja environment
ENVIRONMENT_CASES = [
    # trim_blocks + lstrip_blocks: the tag lines and their indentation vanish
    ("  {% if true %}\nA\n  {% endif %}\nB\n    {%- if true %} C{% endif %}", []),
    # loopcontrols
    ("{% for m in messages %}{% if loop.index0 > 1 %}{% break %}{% endif %}"
     "{% if loop.first %}{% continue %}{% endif %}{{ m.content }}|{% endfor %}",
     [{"role": "user", "content": c} for c in "abcd"]),
    # tojson: no HTML escaping, unicode kept, its options
    ("{{ messages | tojson }}|{{ messages | tojson(indent=2, sort_keys=True) }}|"
     "{{ '<&>\\'' | tojson }}|{{ messages | tojson(separators=(',', ':'), ensure_ascii=True) }}",
     [{"role": "user", "content": "<b>é & 中 🙂</b>"}]),
    # named special tokens are variables; documents is none; tools is none when not given
    ("{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ unk_token }}|{{ documents is none }}|"
     "{{ tools is none }}|{{ add_generation_prompt }}", []),
    # dict() and namespace()
    ("{% set d = dict(a=1, b=[2]) %}{{ d.a }}{{ d | tojson }}{{ dict.fromkeys(['x'], 2) }}"
     "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
     "{{ ns.n }}", [{"role": "user", "content": "x"}] * 3),
    # {% generation %} renders its body
    ("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
     [{"role": "assistant", "content": "hi"}]),
    # None-valued keys are dropped; reasoning under any of its names is aliased
    ("{% for m in messages %}{{ m.content is defined }}/{{ m.reasoning_content }}/"
     "{{ m.thinking }}/{{ m | tojson }};{% endfor %}",
     [{"role": "assistant", "content": None, "reasoning": "r1"},
      {"role": "assistant", "content": "c", "thinking": "t2", "name": None}]),
    # strftime_now (the year: stable within a test run)
    ("{{ strftime_now('%Y') }}", []),
    # message attributes, string methods and filters the sandbox allows
    ("{% for m in messages %}{{ m['role'] | upper }}:{{ m.content.strip().split(' ') | "
     "join(',') }}{{ '\\n' if not loop.last }}{% endfor %}",
     [{"role": "user", "content": " a b  c "}, {"role": "assistant", "content": "d"}]),
]


def test_jinja_environment_matches_transformers(pair):
  ours, hf = pair
  for template, messages in ENVIRONMENT_CASES:
    want = hf.apply_chat_template(messages or [{"role": "user", "content": ""}],
                                  chat_template=template, tokenize=False)
    got = chat.render(ours, messages or [{"role": "user", "content": ""}],
                      chat_template=template)
    assert got == want, template


def test_template_errors_are_refused_like_transformers(pair):
  ours, hf = pair
  messages = [{"role": "user", "content": "x"}]
  for template, needle in [("{{ raise_exception('no system role here') }}", "no system role"),
                           ("{% set ns = namespace(_secret=1) %}", "underscore"),
                           ("{{ messages.__class__ }}{{ ''.__class__.__mro__ }}", "unsafe")]:
    with pytest.raises(jinja2.TemplateError):
      hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    with pytest.raises(chat.ChatError, match=needle):
      chat.render(ours, messages, chat_template=template)


def test_special_token_text_in_user_content_becomes_control_tokens(pair, folder):
  """The documented choice: as transformers' apply_chat_template(tokenize=True), special-token
  text inside content encodes as the control token; transformers' opt-in sanitizing cannot
  help with this remote code (its _tokenize always allows special tokens)."""
  ours, hf = pair
  messages, _ = conversations.CONVERSATIONS["tricky_user"]
  ids = ours.encode_chat(messages)
  im_end = folder[1]["<|im_end|>"]
  assert np.sum(ids == im_end) == 4  # system, user's own text, user turn end, assistant
  with pytest.raises(ValueError, match="Can't sanitize"):
    hf.apply_chat_template(messages, tokenize=True, sanitize_control_tokens=True)
  assert chat.special_text_in_content(ours, messages) == [
      "<|im_assistant|>", "<|im_end|>", "<|im_middle|>"]
