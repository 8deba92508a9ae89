import pytest
import torch

from h2okv.testing import TINY_CONFIGS, tiny_model

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
