"""The eval hold-out rule shared by documents (data.py) and chat rows (chat_data.py): one item
in EVAL_EVERY, by position, is held out for eval."""

EVAL_EVERY = 16


def is_held_out(i: int) -> bool:
  """Item i (0-based, in the corpus's sorted order) goes to eval: positions 8, 24, 40, ..."""
  return i % EVAL_EVERY == EVAL_EVERY // 2
