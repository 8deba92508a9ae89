"""The eviction core. Import from the modules (``h2okv.core.cache.H2OCache``; the package
``h2okv`` re-exports the public names): the package itself loads nothing, so budget arithmetic
(reports, argument checks) does not pay for transformers.

| module | job |
| --- | --- |
| ``cache.py`` | ``H2OCache``: settings checked once, its layers built, the public row operations, stats |
| ``budget.py`` | ``BudgetSpec`` (what the user asked for) and ``RowBudgets`` (each row's slots, fixed by its first call, shared by the layers) |
| ``layer.py`` | ``SlotLayer``: transformers' cache-layer protocol, routing a forward call, prefill modes, accounting |
| ``storage.py`` | one layer's slot buffers: resize, compaction, row operations, the flat (ragged) layout |
| ``decode.py`` | the decode step of a layer: one stepper per engine, chosen when the rows change |
| ``step.py`` | the eviction rule (once) and the general step of any other call |
| ``scan.py`` | per-token eviction over a whole call, the recurrence only |
| ``attention.py`` | the registered attention function, the update -> attend hand-over, the mass-returning attention over slots, model preparation |
| ``reconstruction.py`` | KVzip's reconstruction pass (``h2okv.reconstruct``, ``h2okv.read_context``) and the probe attention a layer runs in it |
| ``head_budget.py`` | head-adaptive and cache-wide budgets (Ada-KV, KVzip) |
| ``positions.py``, ``rope.py`` | rolling positions: keys re-rotated to stay inside the model's window |
| ``kernels.py``, ``native/``, ``triton_*.py`` | which kernels run; the C steps (CPU) and the Triton ones (CUDA) |
| ``reference.py`` | Algorithm 1 as a plain per-token loop: the spec the tests hold every path to |
"""
