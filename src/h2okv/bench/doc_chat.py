"""A chat over a document as users have it, graded: CoQA's real conversations for the chat profile.

Each document is a system message holding several of CoQA's stories, each under a name (one
document of a few thousand tokens, as a user pastes one). Several conversations share a document,
each about another of its stories: turn ``k`` asks CoQA's ``k``-th question of that story's
conversation ("About story NAME: ..."), in order, and the history holds the model's own earlier
answers (a question may lean on them: "what did she do then?"). Every answer is graded by
whether it holds one of CoQA's gold answers (``qa_recall``: the share of the gold answer's words in
the reply; a chat model answers in sentences, which F1 counts against it), with SQuAD's token F1
beside it (``eval.longctx.metric``).

The stories come from the half of CoQA that ``seed``'s parity picks (``eval.longctx.qa.half``):
seed 1, the default, is the test split's half, the stories no recipe was chosen on.
"""

from __future__ import annotations

import random

from h2okv.errors import H2OError

ASK = "About story {name}: {question} Answer in a few words, with no explanation."
SYSTEM = "Answer questions about the stories below, each under its name.\n\n"


def coqa_chats(tokenizer, documents: int, per_document: int, turns: int, doc_tokens: int, seed: int = 1) -> list[dict]:
    """``documents`` x ``per_document`` conversations of ``turns`` graded turns, in the form of
    ``bench.chat.conversations``; each document about ``doc_tokens`` tokens of whole stories."""
    from h2okv.eval import qa_data
    from h2okv.eval.longctx.qa import half
    from h2okv.eval.longctx.words import variable_names

    rng = random.Random(seed)
    stories = half(qa_data.coqa_conversations(), seed, lambda c: c.story)
    long_enough = [c for c in stories if len(c.turns) >= turns]
    if len(long_enough) < documents * per_document:
        raise H2OError(f"CoQA's half holds {len(long_enough)} stories of {turns}+ turns; "
                       f"{documents} x {per_document} conversations need more")
    asked = rng.sample(long_enough, documents * per_document)
    chosen = {c.story for c in asked}
    others = [c for c in stories if c.story not in chosen]
    rng.shuffle(others)
    out = []
    for d in range(documents):
        gold = asked[d * per_document : (d + 1) * per_document]
        names = variable_names(rng, per_document + len(others))
        named = list(zip(names, gold, strict=False))
        filler = iter(zip(names[per_document:], others, strict=False))
        while tokens(tokenizer, named) < doc_tokens:
            found = next(filler, None)
            if found is None:
                raise H2OError(f"not enough CoQA stories for a {doc_tokens}-token document")
            named.append(found)
        rng.shuffle(named)
        system = SYSTEM + "".join(f"Story {name}:\n{c.story}\n\n" for name, c in named).rstrip() + "\n"
        for k, conv in enumerate(gold):
            name = next(n for n, c in named if c is conv)
            out.append({"id": d * per_document + k, "document": d, "system": system, "story": name,
                        "turns": [{"ask": ASK.format(name=name, question=t.question), "references": list(t.answers),
                                   "metric": "qa_recall", "also": "qa_f1"} for t in conv.turns[:turns]]})
    return out


def tokens(tokenizer, named) -> int:
    return len(tokenizer("".join(f"Story {n}:\n{c.story}\n\n" for n, c in named), add_special_tokens=False)["input_ids"])
