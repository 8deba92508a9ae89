"""RoPE as pure rotations: the model's frequencies, and moving a rotated key to another position.

A RoPE model rotates each (i, i + D/2) pair of a query or key by ``position * inv_freq[i]`` and
multiplies by ``attention_scaling`` (YaRN; 1 otherwise): ``x -> s * R(p) x``. Rotations compose,
``R(a) R(b) = R(a + b)``, and commute with the scalar ``s``, so a key the model rotated to ``p``
is moved to ``p + delta`` by ``R(delta)`` alone, whatever the scaling variant (linear, Llama 3,
YaRN only change ``inv_freq`` and ``s``, both fixed by the config). Variants whose frequencies
depend on the sequence length (dynamic NTK, LongRoPE) are refused, as is partial rotary for
rolling (``partial_ok`` lets a caller turn only the rotated share, as ``expected`` does): there the
rotation of an old key is not a function of its position alone, or covers part of the head.

``RopeRotation.from_model`` takes ``inv_freq`` from transformers' own ``ROPE_INIT_FUNCTIONS``
(or the model's default computation) and checks it against the model: it rotates a probe with the
model's rotary embedding and ``apply_rotary_pos_emb`` at two positions and requires our rotation
of one to give the other, so a model with another convention (interleaved pairs) is refused
instead of silently mis-rotated.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from h2okv.core.compat import config_head_dim
from h2okv.errors import H2OError

# rope types whose rotation depends only on the position (inv_freq and scaling fixed by the config)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def rotary_module(model):
    """The model's rotary embedding module (one per model in transformers 5), or None."""
    base = getattr(model, "base_model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    return rotary


def has_static_rope(config) -> bool:
    """Whether a (transformers) config's model turns its keys with a RoPE of fixed frequencies
    (``STATIC_ROPE``), read from the config alone (``RopeRotation.from_model`` checks the model)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(config, "rope_parameters", None)
    return isinstance(params, dict) and params.get("rope_type", "default") in STATIC_ROPE


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type", "default") if isinstance(params, dict) else "default"


@dataclass
class RopeRotation:
    """The model's RoPE frequencies; ``rotate_`` moves keys along their positions in place."""

    inv_freq: torch.Tensor  # [R/2] float64
    head_dim: int
    # the first R dimensions are rotated (R = D unless ``partial_ok``: GPT-NeoX turns a share)
    rotary_dim: int = 0

    def __post_init__(self):
        self.rotary_dim = self.rotary_dim or self.head_dim

    @classmethod
    def from_model(cls, model, partial_ok: bool = False) -> RopeRotation:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        name = type(model).__name__
        config = model.config.get_text_config()
        rotary = rotary_module(model)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise H2OError(f"{name} has no rotary position embedding (RoPE), so its positions cannot roll")
        rope_type = _rope_type(config)
        if rope_type not in STATIC_ROPE:
            raise H2OError(f"{name} uses rope_type={rope_type!r}, whose frequencies depend on the length; "
                           f"rolling supports {', '.join(STATIC_ROPE)}")
        if rope_type == "default":
            inv_freq, _ = type(rotary).compute_default_rope_parameters(config)
        else:
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
        head_dim = config_head_dim(config)
        if 2 * inv_freq.numel() != head_dim and not partial_ok:
            raise H2OError(f"{name} rotates only {2 * inv_freq.numel()} of {head_dim} head dimensions "
                           f"(partial rotary), which rolling does not support")
        if not torch.allclose(inv_freq.float(), rotary.original_inv_freq.float().cpu(), rtol=1e-5):
            raise H2OError(f"{name}'s rotary frequencies differ from its config's {rope_type!r} RoPE")
        rope = cls(inv_freq.double(), head_dim, 2 * inv_freq.numel())
        rope.check_against(model, rotary)
        return rope

    def check_against(self, model, rotary) -> None:
        """Our rotation of a probe from position 3 to 11 must equal the model's own rotation at 11."""
        attn = next((m for m in model.modules() if type(m).__name__.endswith("Attention")), None)
        apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None) if attn else None
        if apply is None:
            raise H2OError(f"{type(model).__name__}: found no apply_rotary_pos_emb to check RoPE against")
        probe = torch.randn(1, 1, 1, self.head_dim, generator=torch.Generator().manual_seed(0)).expand(1, 1, 2, -1)
        device = rotary.inv_freq.device
        cos, sin = rotary(probe.to(device), torch.tensor([[3, 11]], device=device))
        rotated, _ = apply(probe.to(device), probe.to(device), cos, sin)
        moved = rotated[:, :, :1].float().cpu().clone()
        self.rotate_(moved, torch.tensor([[[8]]]))
        if not torch.allclose(moved, rotated[:, :, 1:].float().cpu(), atol=1e-4):
            raise H2OError(f"{type(model).__name__} applies RoPE in a layout rolling does not know "
                           f"(not the rotate-half convention)")

    def rotate_(self, keys: torch.Tensor, delta: torch.Tensor) -> None:
        """Move ``keys`` ``[B, H, n, D]`` by ``delta`` ``[B, H, n]`` positions, in place.

        The angle is formed in float64 (a delta of 60k times the top frequency must not lose the
        fractional turn), the rotation in float32, the result written back in the keys' dtype."""
        half, rot = self.rotary_dim // 2, self.rotary_dim
        wide = torch.float64 if keys.device.type in ("cpu", "cuda") else torch.float32
        angle = delta.to(wide)[..., None] * self.inv_freq.to(device=keys.device, dtype=wide)
        cos, sin = angle.cos().float(), angle.sin().float()
        first, second = keys[..., :half].float(), keys[..., half:rot].float()  # views when keys are float32
        new_first = first * cos - second * sin
        keys[..., half:rot] = second * cos + first * sin
        keys[..., :half] = new_first
