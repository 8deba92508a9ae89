"""Tokenizers of one id per character for tiny models (no files, no network)."""

import string


class Tok:
    """One id per character (no chat template: the probe's turn end is a newline)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}


class CharTokenizer:
    """A reversible one-id-per-character tokenizer inside the tiny models' vocabulary (96)."""

    pad_token_id = 1
    chars = "\n .?,!'" + string.digits + string.ascii_letters

    def __init__(self):
        self.index = {c: i + 2 for i, c in enumerate(self.chars)}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.index.get(c, 3) for c in text]}  # unknown characters read as a space

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.chars[i - 2] if 2 <= i < 2 + len(self.chars) else "" for i in ids)

    def batch_decode(self, rows, skip_special_tokens=False):
        return [self.decode(list(map(int, row))) for row in rows]


class Chars(CharTokenizer):
    """Characters enough for UUIDs, "VAR X = Y", key-words ("alpha-beta: 123") and a chat frame."""

    chars = CharTokenizer.chars + "-:=()<>/"
