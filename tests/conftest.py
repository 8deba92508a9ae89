import pytest
import torch

from h2okv.testing import TINY_CONFIGS, VOCAB, tiny_model

torch.set_grad_enabled(False)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(params=sorted(TINY_CONFIGS))
def arch_model(request):
    return request.param, tiny_model(request.param)


def random_ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB - 2, (batch, n), generator=g)


@pytest.fixture(scope="session")
def default_model():
    """The real embedded SmolLM2-135M-Instruct (loaded once per test session)."""
    from h2okv import load_model

    return load_model()
