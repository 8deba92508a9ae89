"""``h2okv serve``: an OpenAI-compatible server whose decode batches grow with the KV memory H2O frees.

``create_app(model, tokenizer, ...)`` builds the FastAPI app (routes in ``app.py``) around one
``Engine`` (``engine.py``: continuous batching in a background thread), admitting requests by the KV
memory they will hold (``memory.py``).
"""

from h2okv.serve.app import EvictionDefaults, create_app
from h2okv.serve.engine import Engine, GenerationRequest
from h2okv.serve.server import running_server, serve_forever

__all__ = ["Engine", "EvictionDefaults", "GenerationRequest", "create_app", "running_server", "serve_forever"]
