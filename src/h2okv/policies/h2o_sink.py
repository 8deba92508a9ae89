"""``h2o-sink``: heavy hitters, with the first 4 tokens of a sequence (attention sinks) never evicted.

Softmax dumps surplus mass on the first tokens whatever they say; H2O usually keeps them for that
reason, but not always (a long text spreads the sum). Protecting them costs at most 4 heavy slots.
"""

from h2okv.policies.h2o import H2OPolicy


class H2OSinkPolicy(H2OPolicy):
    name = "h2o-sink"
    sink_tokens = 4
