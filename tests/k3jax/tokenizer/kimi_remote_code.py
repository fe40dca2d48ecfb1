"""A transformers remote-code tokenizer shaped like the `tokenization_kimi.py` that Kimi
checkpoints ship (written for these tests, not copied): a `PreTrainedTokenizer` over tiktoken
whose class holds the pre-tokenisation regex `pat_str` and `num_reserved_special_tokens`, whose
reserved ids are named from `added_tokens_decoder`, whose `encode` guards long texts (400k-char
chunks, runs of <= 25k whitespace / non-whitespace characters) and allows special tokens, and
whose `apply_chat_template` sorts tool schemas' keys before the Jinja template renders them.

The tests copy it into a synthetic model folder as `tokenization_kimi.py` and load that folder
with `AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`; k3jax reads the same file
without running it."""

import os

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
  vocab_files_names = {"vocab_file": "tiktoken.model"}
  model_input_names = ["input_ids", "attention_mask"]
  num_reserved_special_tokens = 256
  pat_str = "|".join([
      r"""\p{Han}+""",
      r"""[^\r\n\p{L}\p{N}]?\p{L}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
      r"""\p{N}{1,3}""",
      r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
      r"""\s*[\r\n]+""",
      r"""\s+(?!\S)""",
      r"""\s+""",
  ])

  def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None,
               pad_token=None, additional_special_tokens=None, added_tokens_decoder=None,
               **kwargs):
    names = {i: t.content for i, t in (added_tokens_decoder or {}).items()}
    self.vocab_file = vocab_file
    ranks = load_tiktoken_bpe(vocab_file)
    first = len(ranks)
    self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                           for i in range(first, first + self.num_reserved_special_tokens)}
    self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=self.pat_str,
                                   mergeable_ranks=ranks, special_tokens=self.special_tokens)
    self.n_words = self.model.n_vocab
    self.byte_encoder = bytes_to_unicode()
    self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
    self.decoder = {i: "".join(self.byte_encoder[b] for b in
                               self.model.decode_single_token_bytes(i))
                    for i in range(self.n_words)}
    self.encoder = {text: i for i, text in self.decoder.items()}
    super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                     pad_token=pad_token, additional_special_tokens=additional_special_tokens,
                     added_tokens_decoder=added_tokens_decoder, **kwargs)

  @staticmethod
  def _guarded(text, max_chars, max_run):
    """Chunks of <= max_chars characters, cut so that no run of whitespace or of
    non-whitespace characters is longer than max_run."""
    for i in range(0, max(len(text), 1), max_chars):
      chunk, start, run, kind = text[i:i + max_chars], 0, 0, None
      for j, ch in enumerate(chunk):
        if ch.isspace() == kind:
          run += 1
        else:
          kind, run = ch.isspace(), 1
        if run > max_run:
          yield chunk[start:j]
          start, run = j, 1
      yield chunk[start:]

  def encode(self, text, allow_special_tokens=True, **kwargs):
    if kwargs:  # transformers' own options: its generic path, which ends in _tokenize
      return super().encode(text, **kwargs)
    TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # the release's names for its guards
    MAX_NO_WHITESPACES_CHARS = 1_000  # the release: 25_000; tests reach 1k cheaply
    ids = []
    for piece in self._guarded(text, TIKTOKEN_MAX_ENCODE_CHARS, MAX_NO_WHITESPACES_CHARS):
      ids += (self.model.encode(piece, allowed_special="all") if allow_special_tokens
              else self.model.encode(piece, disallowed_special=()))
    return ids

  def decode(self, token_ids, **kwargs):
    if kwargs:
      return super().decode(token_ids, **kwargs)
    return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

  @property
  def vocab_size(self):
    return self.n_words

  def get_vocab(self):
    return self.encoder

  def _tokenize(self, text, **kwargs):
    return [self.decoder[i] for i in self.encode(text)]

  def _convert_token_to_id(self, token):
    return self.encoder.get(token, self.unk_token_id)

  def _convert_id_to_token(self, index):
    return self.decoder.get(index)

  def convert_tokens_to_string(self, tokens):
    return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

  def save_vocabulary(self, save_directory, filename_prefix=None):
    raise NotImplementedError

  def apply_chat_template(self, conversation, tools=None, tokenize=False,
                          add_generation_prompt=True, **kwargs):
    return super().apply_chat_template(conversation, tools=sort_keys(tools), tokenize=tokenize,
                                       add_generation_prompt=add_generation_prompt, **kwargs)


def sort_keys(value):
  """Dicts with their keys in sorted order, recursively (tool schemas render canonically)."""
  if isinstance(value, dict):
    return {k: sort_keys(value[k]) for k in sorted(value)}
  if isinstance(value, list):
    return [sort_keys(v) for v in value]
  return value
