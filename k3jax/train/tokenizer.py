"""Training's view of the tokenizers; they live in `k3jax.tokenizer` (kept importable here)."""

import importlib.util  # noqa: F401  (tests patch importlib.util.find_spec through this module)

from k3jax.tokenizer import (TIKTOKEN_FILE, ByteTokenizer, find_tiktoken_file,  # noqa: F401
                             load_tokenizer, read_pattern)
