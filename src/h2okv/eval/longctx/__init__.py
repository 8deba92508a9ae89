"""``h2okv eval longctx``: RULER's synthetic long-context tasks, generated offline as token ids of
an exact length, run under each policy and budget with the question seen or not seen by the
compression, scored with RULER's metric.

- ``metric.py``, ``rows.py``: the metric and the JSON rows; standard library only, because the
  kvpress adapter (``tools/peer/run_kvpress.py``, its own venv, no h2okv) loads them by path;
- ``words.py``: the seeded random strings (numbers, word pairs, UUIDs, coded words, variables);
- ``prompt.py``: the prompt frame (chat template, instruction, question, answer prefix) and sizes;
- ``tasks.py``: the task generators (needles, variable tracking, common / frequent words);
- ``runner.py``: the grid, the two question modes, the export for the peer;
- ``report.py``: the table and the plot.
"""
