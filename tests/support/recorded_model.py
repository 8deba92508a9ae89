"""A tiny Llama that ``h2okv.models.load_model`` returns in a test, recording what ``generate`` is fed:
the CLI runs on it as on a real model, and a test sees which prompts (and in which batches) ran."""

import h2okv.models
from char_tokenizers import Chars
from h2okv.tools.tiny import tiny_model


def recorded_tiny_model(monkeypatch, record):
    """The model; ``record(input_ids_as_lists)`` is called with every ``generate`` call's ids (pass
    ``list.extend`` for the prompts, ``list.append`` for the calls)."""
    model = tiny_model("llama", seed=3, max_position_embeddings=2048)
    model.name_or_path = "/converted/folder"
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, Chars()))
    generate = model.generate

    def recording_generate(input_ids, **kwargs):
        record(input_ids.tolist())
        return generate(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", recording_generate)
    return model
