"""The eval hold-out rule of every corpus k3jax trains on: one item in `every`, by position,
is held out whole for eval and never trained.

- Documents of a text folder and rows of a chat JSONL file (k3jax/train/data.py,
  chat_data.py): `every` = EVAL_EVERY = 16, items 8, 24, 40, ...
- A prepared dataset (prepared.py) of N documents: `every` = max(16, N // MAX_HELD_OUT), so
  at most about MAX_HELD_OUT documents (a 1T-token corpus does not hold out 1/16 of itself),
  spread evenly over the whole corpus (over every source it was prepared from); the manifest
  records `every`, fixed when prepare-data finishes.
"""

EVAL_EVERY = 16
MAX_HELD_OUT = 1024


def is_held_out(i: int, every: int = EVAL_EVERY) -> bool:
  """Item i (0-based, in the corpus's order) goes to eval: positions every/2, 3 every/2, ..."""
  return i % every == every // 2


def held_out_every(n: int) -> int:
  """The hold-out stride of a prepared dataset of n documents."""
  return max(EVAL_EVERY, n // MAX_HELD_OUT)


def held_out_count(n: int, every: int) -> int:
  """How many of items 0..n-1 are held out."""
  return n // every + (n % every > every // 2)


def train_item(j: int, every: int) -> int:
  """The position of the j-th trained (not held-out) item: each block of `every` items holds
  `every - 1` trained ones, the one at every // 2 skipped."""
  block, r = divmod(j, every - 1)
  return block * every + r + (r >= every // 2)


def held_out_item(h: int, every: int) -> int:
  """The position of the h-th held-out item."""
  return h * every + every // 2
