"""What a request that gives no ``temperature`` / ``top_p`` samples with.

OpenAI's API defaults both to 1. For a small instruct model that is far hotter than its authors
intend: the embedded SmolLM2-135M-Instruct answered "What is the capital of France?" at
temperature 1 with "L'Étre - The African-American Soldier by the Name of Madame Capuleto". So, as
vLLM does with a model's ``generation_config.json``, the server's defaults are, first to last:

1. the server's ``--temperature`` / ``--top-p``;
2. the values the model's generation config sets (a Hugging Face checkpoint's own file);
3. for the built-in models, whose files are converted from GGUF and carry none, ``BUILT_IN``;
4. OpenAI's 1 and 1.

A request's own values always win. ``/v1/models`` shows the defaults and where they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

OPENAI = (1.0, 1.0)

# (temperature, top_p, where from) of the built-in models. Qwen's: its checkpoints' generation
# config (their top_k 20 and repetition penalty are not API fields here). The embedded SmolLM2 is
# 4-bit: at its model card's 0.2 / 0.9, 4 of 10 answers to "What is the capital of France?" were
# French word salad ("L'Étoile, la Marseillaise, la femme, ..."), greedy 10 of 10 were "The capital
# of France is Paris.", so it decodes greedily, as `h2okv generate` does.
BUILT_IN = {
    "smollm2": (0.0, 1.0, "greedy, as `h2okv generate`, for the 4-bit embedded model"),
    "qwen2.5-0.5b": (0.7, 0.8, "Qwen2.5-Coder-Instruct's generation config"),
    "qwen2.5-1.5b": (0.7, 0.8, "Qwen2.5-Coder-Instruct's generation config"),
}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = OPENAI[0]
    top_p: float = OPENAI[1]
    source: str = "OpenAI's defaults"

    def describe(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "sampling_defaults_from": self.source}

    @classmethod
    def resolve(cls, model_name: str | None = None, generation_config=None, temperature: float | None = None,
                top_p: float | None = None) -> SamplingDefaults:
        """The defaults for a server of ``model_name`` (a built-in name, or anything else) whose
        model carries ``generation_config``; ``temperature`` / ``top_p``: the server's flags."""
        chosen = {"temperature": temperature, "top_p": top_p}
        sources = {name: "--" + name.replace("_", "-") + " flag" for name, value in chosen.items() if value is not None}
        given = _set_in(generation_config)
        built_in = BUILT_IN.get(model_name or "")
        for index, name in enumerate(("temperature", "top_p")):
            if chosen[name] is not None:
                continue
            if name in given:
                chosen[name], sources[name] = float(given[name]), "the model's generation config"
            elif built_in is not None:
                chosen[name], sources[name] = built_in[index], built_in[2]
            else:
                chosen[name], sources[name] = OPENAI[index], "OpenAI's defaults"
        if all(source.endswith(" flag") for source in sources.values()):
            source = "the server's flags"
        elif sources["temperature"] == sources["top_p"]:
            source = sources["temperature"]
        else:
            source = f"temperature: {sources['temperature']}; top_p: {sources['top_p']}"
        return cls(chosen["temperature"], chosen["top_p"], source)


def _set_in(generation_config) -> dict:
    """The sampling values a generation config file sets (not transformers' class defaults)."""
    if generation_config is None:
        return {}
    try:
        values = generation_config.to_diff_dict()
    except Exception:  # noqa: BLE001 - an odd config only loses its defaults, never the server
        return {}
    found = {name: values.get(name) for name in ("temperature", "top_p")}
    # only values a request could give (the API's ranges); anything else is left to the next source
    return {name: value for name, value in found.items() if isinstance(value, (int, float))
            and not isinstance(value, bool) and (0 <= value <= 2 if name == "temperature" else 0 < value <= 1)}
