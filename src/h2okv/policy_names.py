"""The names of the eviction policies, in the order help texts list them.

Kept apart from ``h2okv.policies`` (which imports torch) so that the command line can list them
in ``--help`` without loading torch; ``h2okv.policies`` builds its registry in this order and
fails on import when a policy class is missing from this list or the list names one it lacks.
"""

POLICY_NAMES = ("full", "h2o", "local", "sink", "random", "tova", "h2o-sink", "h2o-mean", "snapkv", "knorm",
                "rkv", "expected", "kvzip")

# policies that rank a prompt by reconstructing it (``h2okv.reconstruct``): only the commands that
# run that pass accept them
RECONSTRUCTION_POLICIES = ("kvzip",)
