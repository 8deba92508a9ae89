"""The ``"h2o"`` attention function registered with transformers, and model preparation.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function. Our cache's
update only records the new states; this function sees that the key it receives is the one the
cache just recorded and does the slot work there (it has the query). For any other cache (a
plain ``DynamicCache``, no cache) it is ordinary SDPA, so the model keeps working as before.

``PENDING`` is the hand-over: ``SlotLayer.update`` records ``(layer, key_states, value_states)``
in it, per thread, and the attention function checks that the key it receives is that same
object before it takes the query to ``SlotLayer.attend``.
"""

from __future__ import annotations

from contextvars import ContextVar

from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from h2okv.errors import H2OError

ATTN_NAME = "h2o"
PENDING: ContextVar[tuple | None] = ContextVar("h2okv_pending", default=None)

_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def h2o_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    pending = PENDING.get()
    if pending is None or pending[1] is not key:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise H2OError(f"{type(module).__name__} uses {name!r}, which H2O attention does not support")
    PENDING.set(None)
    layer = pending[0]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = layer.attend(query, key, value, attention_mask, scaling, sliding_window=kwargs.get("sliding_window"))
    return out, None


def _register() -> None:
    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, h2o_attention_forward)
        # the mask is the ordinary boolean SDPA mask; our cache sizes it to the new tokens only
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def attention_modules(model):
    """(layer_idx, module) for every self-attention module that goes through the interface."""
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx is not None and hasattr(module, "config") and type(module).__name__.endswith("Attention"):
            yield idx, module


def check_supported(model) -> int:
    """Raise ``H2OError`` naming the reason if H2O cannot run on ``model``; return its layer count."""
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise H2OError(f"{name} is an encoder-decoder model; h2okv supports decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise H2OError(
            f"{name} does not route attention through transformers' AttentionInterface, so H2O cannot plug in"
        )
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t != "full_attention" and t != "sliding_attention"})
    if odd:
        raise H2OError(f"{name} has {', '.join(odd)} layers; h2okv supports attention-only decoders")
    if getattr(text, "attn_logit_softcapping", None):
        raise H2OError(f"{name} soft-caps attention logits, which H2O attention does not support")
    layers = {idx for idx, _ in attention_modules(model)}
    if not layers:
        raise H2OError(f"{name}: found no attention modules with a layer index")
    return max(layers) + 1


def prepare_model(model) -> int:
    """Route the model's attention through ``h2o_attention_forward``; returns the number of layers.

    Idempotent. The model still runs normally with any other cache afterwards.
    """
    num_layers = check_supported(model)
    _register()
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    return num_layers
