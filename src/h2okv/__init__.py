"""h2okv: H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face transformers, with real
memory savings, batching and grouped-query attention."""

from .cache import H2OCache
from .errors import H2OError
from .models import load_model
from .policies import POLICIES

__all__ = ["H2OCache", "H2OError", "POLICIES", "load_model"]
__version__ = "0.1.0"
