import pytest

from h2okv.tools.tiny_chat import tiny_chat_model


@pytest.fixture(scope="module")
def model_tok():
    """The engine tests' tiny chat model (a module that needs another defines its own ``model_tok``,
    which pytest prefers). A large init scale gives varied, confident greedy outputs: a wrong
    eviction or position changes them."""
    return tiny_chat_model(layers=3, initializer_range=0.3)
