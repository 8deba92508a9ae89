import os
import sys
from pathlib import Path

import pytest
import torch

# the tests' shared helpers (tests/support: tp_group, serve_requests, ...) import by their module
# names from every folder, and from the ranks and servers the tests spawn
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# Triton's interpreter (its kernels on CPU tensors) must be chosen before triton is first imported:
# without a GPU, tests/core/test_kernels.py runs the Triton kernels that way
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from h2okv.tools.tiny import TINY_CONFIGS, tiny_model, word_tokenizer

torch.set_grad_enabled(False)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(params=sorted(TINY_CONFIGS))
def arch_model(request):
    return request.param, tiny_model(request.param)


@pytest.fixture(scope="session")
def default_model():
    """The real embedded SmolLM2-135M-Instruct (loaded once per test session)."""
    from h2okv import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama checkpoint + word-level tokenizer on disk, for code that loads by path."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tp_group(tmp_path_factory):
    """The session's 2-rank tensor-parallel group (tests/support/tp_group.py): one start for every TP test
    that needs a healthy group (tests/parallel/test_distributed.py, tests/serve/test_tp.py)."""
    from tp_group import TPGroup

    group = TPGroup(tmp_path_factory.mktemp("tp_group"))
    yield group
    group.stop()
