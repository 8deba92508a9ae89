"""A tiny model + tokenizer pair to serve in tests and smoke runs (no downloads, loads in milliseconds).

The tokenizer is byte-level (one token per UTF-8 byte, like GPT-2's alphabet with no merges) with
ChatML special tokens and a chat template, so every string round-trips and multi-byte characters
exercise incremental detokenisation.
"""

from __future__ import annotations

import functools

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    # GPT-2's word-splitting regex, as every real byte-level BPE tokenizer has: the ids are the same
    # bytes either way, but the BPE model caches each pre-tokenised piece (up to 10,000 of them, the
    # tokenizers default). Unsplit, every distinct prompt was one cache entry of a few KB, and a
    # server soak saw that bounded cache fill as a slow RSS climb.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def tiny_chat_model(arch: str = "llama", seed: int = 0, layers: int = 2, max_positions: int = 2048, **overrides):
    """``(model, tokenizer)``: a random ``h2okv.tools.tiny.tiny_model`` sized to the byte-level tokenizer."""
    from h2okv.tools.tiny import tiny_model

    tok = tiny_tokenizer()
    model = tiny_model(arch, seed=seed, layers=layers, vocab_size=len(tok), max_position_embeddings=max_positions,
                       eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id, **overrides)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok
