"""A long forward call's feed-forward in slices of ``FEED_FORWARD_CHUNK`` tokens.

A prompt read in one call (the question-aware recipes rank it with its last queries, so they read
it whole) holds each layer's feed-forward activations for every token at once: the gate, up and
activated projections, each the intermediate size wide (4-8x the hidden size). On Qwen2.5-0.5B
that is ~58 KB a token in float32, more than its K/V (~25 KB) and many times a 20% budget's.
The feed-forward acts on each token alone, so slicing the call along the tokens computes the same
dot products (a matrix product over fewer rows may add them in another order: logits agree to
~1e-7 in float32) and the activations held become one slice's. Measured on the 0.5B, one 8k
call under ``bounded``: a live peak of 337 MiB above the weights against 692 MiB unsliced
(``tools/measure/prefill_memory.py``; docs/RESULTS.md).

Applied by ``prepare_model`` to the decoder layers' ``mlp`` modules of the dense families we run
(their classes end in ``MLP``; a mixture of experts, which returns router logits beside its
output, is left whole). The model runs as before with any cache; ``unslice_feed_forward`` (from
``restore_model``) gives each module its own forward back.
"""

from __future__ import annotations

import torch

FEED_FORWARD_CHUNK = 512  # tokens a slice; one GEMM of 512 rows keeps the matmul efficient
_MARK = "_h2okv_sliced"


def slice_feed_forward(model, tokens: int = FEED_FORWARD_CHUNK) -> int:
    """Make every dense ``mlp`` of ``model`` run calls longer than ``tokens`` in slices; idempotent.
    Returns how many modules it changed this time."""
    if tokens < 1:
        raise ValueError(f"a feed-forward slice must be >= 1 token, got {tokens}")
    changed = 0
    for name, module in model.named_modules():
        if not name.endswith(".mlp") or not type(module).__name__.endswith("MLP") or getattr(module, _MARK, False):
            continue
        # a forward set on the module itself (a hook library's) is put back on restore, not the class's
        module.forward = _sliced(module.forward, tokens, replaced_own="forward" in vars(module))
        setattr(module, _MARK, True)
        changed += 1
    return changed


def unslice_feed_forward(model) -> int:
    """Undo ``slice_feed_forward`` where its slicing is still the module's forward (one wrapped
    again since stays sliced: removing ours would remove the wrapper around it). Returns how many
    modules it gave their forward back."""
    restored = 0
    for module in model.modules():
        forward = vars(module).get("forward")
        if not getattr(module, _MARK, False) or not hasattr(forward, "replaced_own"):
            continue
        if forward.replaced_own:
            module.forward = forward.__wrapped__
        else:
            del module.forward  # the class's forward again
        delattr(module, _MARK)
        restored += 1
    return restored


def _sliced(forward, tokens: int, replaced_own: bool):
    def sliced(hidden, *args, **kwargs):
        if args or kwargs or hidden.dim() != 3 or hidden.shape[1] <= tokens:
            return forward(hidden, *args, **kwargs)
        return torch.cat([forward(hidden[:, start:start + tokens]) for start in range(0, hidden.shape[1], tokens)],
                         dim=1)
    sliced.__wrapped__, sliced.replaced_own = forward, replaced_own
    return sliced
