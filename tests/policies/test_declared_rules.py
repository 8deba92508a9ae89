"""Every policy's declared rule (``fold``, ``rank``, ``scores_keys``, ``ranks_upfront``) is what its
hooks compute: the native C and Triton steps run a policy by its declaration alone
(``core/native/rules.py``), so a declaration that lies would run the wrong rule there."""

import pytest
import torch

from h2okv.core.native.rules import native_rule
from h2okv.policies import POLICIES, H2OPolicy, Policy, make_policy

FOLDS = {"add": lambda score, mass: score + mass, "replace": lambda score, mass: mass.clone()}
RANKS = {"score": lambda score, ordinal, n: score,
         "mean": lambda score, ordinal, n: score / (n - ordinal).clamp(min=1),
         "ordinal": lambda score, ordinal, n: ordinal.float()}


def random_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(2, 3, 10, generator=g)
    ordinal = torch.stack([torch.randperm(10, generator=g) for _ in range(6)]).view(2, 3, 10)
    return score, ordinal, torch.full((2, 1, 1), 12)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_hooks_compute_the_declared_rule(name):
    policy = make_policy(name)
    score, ordinal, n_real = random_state()
    if policy.fold is not None and policy.needs_scores:
        mass = torch.rand_like(score)
        folded = score.clone()
        policy.accumulate(folded, mass)
        torch.testing.assert_close(folded, FOLDS[policy.fold](score, mass))
    if policy.rank is not None:
        torch.testing.assert_close(policy.eviction_key(score, ordinal, n_real).float(),
                                   RANKS[policy.rank](score, ordinal, n_real).float())
    keys = torch.randn(2, 3, 5, 8)
    assert policy.scores_keys == (policy.key_scores(keys) is not None)
    assert policy.ranks_upfront == (type(policy).prefill_scores is not Policy.prefill_scores)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_runs_natively_exactly_when_its_rule_is_declared_and_known(name):
    policy = make_policy(name)
    known = (policy.evicts and policy.rank is not None and not policy.scores_keys and not policy.shared_heads
             and (policy.fold is not None or not policy.needs_scores))
    assert (native_rule(policy) is not None) == known


def test_a_subclass_that_overrides_a_hook_without_declaring_runs_the_tensor_op_step():
    class Halved(H2OPolicy):
        def accumulate(self, score, mass):
            score.add_(mass / 2)

    class Fresh(H2OPolicy):
        def eviction_key(self, score, ordinal, n_real, layer_idx=0):
            return -score

    class Declared(H2OPolicy):
        fold = "replace"

        def accumulate(self, score, mass):
            score.copy_(mass)

    assert Halved.fold is None and native_rule(Halved()) is None
    assert Fresh.rank is None and native_rule(Fresh()) is None
    assert native_rule(Declared()) is not None and Declared.fold == "replace"
    assert H2OPolicy.fold == "add" and H2OPolicy.rank == "score"  # the parents keep theirs
