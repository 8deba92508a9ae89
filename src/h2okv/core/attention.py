"""Attention, from transformers' call to the softmax: the registered ``"h2o"`` function, the
hand-over from the cache, the mass-returning attention over slots, and model preparation.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function. Our cache's
update only records the new states; this function sees that the key it receives is the one the
cache just recorded and does the slot work there (it has the query). For any other cache (a
plain ``DynamicCache``, no cache) it is ordinary SDPA, so the model keeps working as before.

``PENDING`` is the hand-over: ``SlotLayer.update`` records ``(layer, key_states, value_states)``
in it, per thread, and the attention function checks that the key it receives is that same
object before it takes the query to ``SlotLayer.attend``.

``slot_attention`` is the attention the steps run over slot buffers (``step.py``). Grouped-query
attention without expanding K/V: the ``g`` query heads that share a KV head are packed into the
query-length axis, ``[B, Hkv, g*m, D]``, so one batched matmul per KV head serves them all, and
summing the probabilities over that axis gives exactly the per-KV-head score H2O accumulates (the
group's heads summed).
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from h2okv.core.feed_forward import slice_feed_forward
from h2okv.core.kernels import triton_on
from h2okv.errors import H2OError

ATTN_NAME = "h2o"
PENDING: ContextVar[tuple | None] = ContextVar("h2okv_pending", default=None)
# the same hand-over while torch.compile traces a forward call: dynamo cannot trace a ContextVar
# (a graph break at every layer) but traces a module-level list, and the value never leaves the
# trace (set in ``update``, taken here, reset to None), so threads share nothing at run time
_TRACED: list = [None]


def set_pending(value) -> None:
    if torch.compiler.is_compiling():
        _TRACED[0] = value
    else:
        PENDING.set(value)


def get_pending():
    return _TRACED[0] if torch.compiler.is_compiling() else PENDING.get()


_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def h2o_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    pending = get_pending()
    if pending is None or pending[1] is not key:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise H2OError(f"{type(module).__name__} uses {name!r}, which H2O attention does not support")
    set_pending(None)
    layer = pending[0]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = layer.attend(query, key, value, attention_mask, scaling, sliding_window=kwargs.get("sliding_window"))
    return out, None


def fused_mass_on(device) -> bool:
    """Whether ``slot_attention`` takes the mass from the Triton kernels on ``device``."""
    return triton_on(device)


def slot_attention(
    query: torch.Tensor,  # [B, Hq, m, D]
    keys: torch.Tensor,  # [B, Hkv, cap, D]
    values: torch.Tensor,  # [B, Hkv, cap, Dv]
    allowed: torch.Tensor | None,  # [B, Hkv, m, cap] bool (or broadcastable on m); None: every slot
    scaling: float,
    need_mass: bool,
    query_weight: torch.Tensor | None = None,  # [B, m] bool: which queries count towards the score
    fused: bool | None = None,  # the Triton kernels for the mass (None: where they run, fused_mass_on)
):
    b, hq, m, d = query.shape
    hkv, cap = keys.shape[1], keys.shape[2]
    g = hq // hkv
    packed = query.reshape(b, hkv, g * m, d)

    if not need_mass:
        mask = None
        if allowed is not None:
            mask = allowed.expand(b, hkv, m, cap)
            if g > 1 and m > 1:  # with one query the [.., 1, cap] mask already broadcasts over the group
                mask = mask[:, :, None].expand(b, hkv, g, m, cap).reshape(b, hkv, g * m, cap)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(b, hq, m, values.shape[-1]), None

    if fused_mass_on(query.device) if fused is None else fused:  # the mass from the log-sum-exp, no probability matrix
        from h2okv.core.triton_attention import triton_slot_attention

        return triton_slot_attention(query, keys, values, allowed, scaling, query_weight)
    # in place where the tensor is fresh: on the decode path every op counts, and in a prefill
    # chunk the logits are the largest tensor there is
    logits = torch.matmul(packed, keys.transpose(-1, -2))
    if logits.dtype != torch.float32:
        logits = logits.float()
    logits.mul_(scaling)
    if allowed is not None:
        # rows are (group head, query): the [m, cap] mask broadcasts over the group, never copied
        hidden = ~allowed.expand(b, hkv, m, cap)
        logits.view(b, hkv, g, m, cap).masked_fill_(hidden[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs if probs.dtype == values.dtype else probs.to(values.dtype), values)
    if query_weight is not None:
        weight = query_weight[:, None, None, :].expand(b, 1, g, m).reshape(b, 1, g * m, 1)
        probs = probs * weight
    mass = probs.sum(dim=2)  # [B, Hkv, cap]
    return out.reshape(b, hq, m, values.shape[-1]), mass


def h2o_mask(*args, q_length=None, attention_mask=None, **kwargs):
    """The ordinary boolean SDPA mask (our cache sizes it to the new tokens only). transformers
    refuses a compileable cache its ``is_causal`` skip at one query, and a mask there would send a
    decode step off its stepper: at one query the skip is allowed again (eager: None when the token
    is real, as for any other cache), and traced, the 2D mask's last column is returned as it is
    (no look at the data; ``SlotLayer.attend`` asserts on the device that the token is real)."""
    if q_length == 1:
        if attention_mask is None:
            return None
        if torch.compiler.is_compiling():
            return attention_mask.to(torch.bool)[:, -1].view(-1, 1, 1, 1)
        kwargs["allow_is_causal_skip"] = True
    return sdpa_mask(*args, q_length=q_length, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, h2o_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, h2o_mask)


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

    Its dense feed-forward runs long calls in slices (``feed_forward.py``: the numbers of one pass,
    up to float rounding; one slice's activations held).
    Idempotent. The model still runs normally with any other cache afterwards.
    """
    num_layers = check_supported(model)
    _register()
    slice_feed_forward(model)  # a prompt read in one call holds one slice's activations, not the prompt's
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    return num_layers
