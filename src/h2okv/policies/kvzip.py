"""``kvzip`` (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"; kvpress's ``KVzipPress``): a token is worth keeping if the model looks at it
while it repeats the prompt.

Question-agnostic: the ranking needs no question. After the prompt has been read whole (late
prefill, nothing evicted), ``h2okv.reconstruct`` feeds the model "repeat the previous context"
followed by the prompt itself, on top of the cache. Those probe tokens are read and never kept;
each cached token's score is the largest attention probability any probe query of its KV head's
group gives it (``core/reconstruction.py``), and each layer then evicts to its budget once. The
probe costs about one more prefill of the prompt. Decode steps afterwards add their attention mass
as in ``h2o``. The first four tokens are kept as attention sinks, as KVzip does.

A cache with this policy must be ranked by ``h2okv.reconstruct`` before it decodes: a forward call
after the prompt without one is a one-line error, never a silent full cache.
"""

from h2okv.policies.h2o import H2OPolicy

SINKS = 4


class KVzipPolicy(H2OPolicy):
    name = "kvzip"
    ranks_by_reconstruction = True
    sink_tokens = SINKS
    ranks_heads = True
