"""The chat server the chat and structured-output tests share (one per session: its programs
compile once): Moonshot's real K2-Thinking tokenizer and the crafted model of helpers.py."""

import pytest

from tests.k3jax.server import helpers


@pytest.fixture(scope="session")
def chat_folders(tmp_path_factory, reference_dir):
  return helpers.chat_run(str(tmp_path_factory.mktemp("chat")), reference_dir)


@pytest.fixture(scope="session")
def chat_server(chat_folders):
  with helpers.serving(chat_folders[0], "--max-model-len", "256") as server:
    yield server
