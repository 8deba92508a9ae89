"""Tiny random-weight models built from configs, for tests and quick experiments (no downloads)."""

from __future__ import annotations

import torch

VOCAB = 96

# architecture -> config overrides; small but with the structure that matters (GQA where the
# architecture has it, RoPE or learned positions, fused or split projections, sliding-window layers)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)),
    "opt": ("OPTConfig", dict(num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1)),
    "gpt_neox": ("GPTNeoXConfig", dict(num_attention_heads=4, rotary_pct=0.5)),
    # Gemma-3: sliding-window and global layers alternating (every 2nd layer global, where the real
    # models have every 6th), one KV head for four query heads, q/k norms; a window of 8 tokens so
    # the tests' sequences cross it
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                        sliding_window=8, sliding_window_pattern=2)),
}


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2, **overrides):
    """A random-weight causal LM of the given architecture, float32, eval mode, on CPU."""
    import transformers

    cls_name, extra = TINY_CONFIGS[arch]
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=VOCAB - 1,
    )
    if arch == "opt":
        base.pop("intermediate_size")
    base.update(extra)
    base.update(overrides)
    config = getattr(transformers, cls_name)(**base)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


class BudgetWatch:
    """A ``LogitsProcessor`` for ``model.generate`` that records ``cache.stats()`` at every
    generated token, to check what the cache holds step by step."""

    def __init__(self, cache):
        self.cache, self.history = cache, []

    def __call__(self, input_ids, scores):
        self.history.append(self.cache.stats())
        return scores


def random_ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Random token ids for the tiny models (avoiding 0/1 and the eos id)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB - 2, (batch, n), generator=g)


def word_tokenizer():
    """A word-level tokenizer over the tiny models' ids ("w2" ... "w94"), left-padding, so text
    pipelines (lm-eval, summarization) can run on tiny models with no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, VOCAB - 1)}, "</s>": VOCAB - 1}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<pad>")
    tok.padding_side = "left"
    return tok


def words(rng, n: int) -> str:
    """``n`` random in-vocabulary words for ``word_tokenizer``."""
    return " ".join(f"w{rng.randint(2, VOCAB - 3)}" for _ in range(n))
