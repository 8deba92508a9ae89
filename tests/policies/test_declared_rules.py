"""Every policy's declared rule (``fold``, ``rank``, ``scores_keys``, ``ranks_upfront``) is what its
hooks compute: the native C and Triton steps run a policy by its declaration alone
(``core/native/rules.py``), so a declaration that lies would run the wrong rule there."""

import pytest
import torch

from h2okv.core.native.rules import C_DECODE_FOLDS, C_DECODE_RANKS, FOLDS, RANKS, c_decode_rule, native_rule
from h2okv.policies import POLICIES, H2OPolicy, Policy, make_policy

# what each declared rule means, written out (the kernels compute these and nothing else)
FOLD_RULES = {"add": lambda score, mass, p: score + mass, "replace": lambda score, mass, p: mass.clone(),
              "decay": lambda score, mass, p: p.decay * score + mass}
RANK_RULES = {"score": lambda score, ordinal, n, keys, p: score,
              "mean": lambda score, ordinal, n, keys, p: score / (n - ordinal).clamp(min=1),
              "ordinal": lambda score, ordinal, n, keys, p: ordinal.float(),
              "rkv": lambda score, ordinal, n, keys, p: rkv_rule(score, keys, p.weight)}
# every policy, and the options that change its declared rule
SPECS = [*sorted(POLICIES), "h2o:decay=0.8", "snapkv:decay=0.9", "rkv:weight=0.5,decay=0.7", "rkv:heads=shared",
         "rkv:kernel=3"]


def rkv_rule(score, keys, weight):
    """R-KV's key with every slot live, pair by pair (the policy computes it in two matrix products)."""
    importance = score / score.sum(-1, keepdim=True)
    cos = torch.nn.functional.cosine_similarity(keys.unsqueeze(-2), keys.unsqueeze(-3), dim=-1)  # [..., n, n]
    n = keys.shape[-2]
    mean_to_others = (cos.sum(-1) - cos.diagonal(dim1=-2, dim2=-1)) / (n - 1)
    return weight * importance - (1 - weight) * torch.softmax(mean_to_others, dim=-1)


def random_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(2, 3, 10, generator=g)
    ordinal = torch.stack([torch.randperm(10, generator=g) for _ in range(6)]).view(2, 3, 10)
    return score, ordinal, torch.full((2, 1, 1), 12)


@pytest.mark.parametrize("name", SPECS)
def test_the_hooks_compute_the_declared_rule(name):
    policy = make_policy(name)
    score, ordinal, n_real = random_state()
    if policy.fold is not None and policy.needs_scores:
        mass = torch.rand_like(score)
        folded = score.clone()
        policy.accumulate(folded, mass)
        torch.testing.assert_close(folded, FOLD_RULES[policy.fold](score, mass, policy))
    if policy.rank is not None:
        keys = torch.randn(*score.shape, 8, generator=torch.Generator().manual_seed(1))
        by_keys = {"keys": keys, "valid": torch.ones_like(score, dtype=torch.bool)} if policy.ranks_by_keys else {}
        torch.testing.assert_close(policy.eviction_key(score, ordinal, n_real, **by_keys).float(),
                                   RANK_RULES[policy.rank](score, ordinal, n_real, keys, policy).float())
    keys = torch.randn(2, 3, 5, 8)
    assert policy.scores_keys == (policy.key_scores(keys) is not None)
    assert policy.ranks_upfront == (type(policy).prefill_scores is not Policy.prefill_scores)


@pytest.mark.parametrize("name", SPECS)
def test_a_policy_runs_natively_exactly_when_its_rule_is_declared_and_known(name):
    """The scan and Triton know FOLDS and RANKS; the C decode step those and "decay", "rkv"."""
    policy = make_policy(name)

    def known(folds, ranks):
        return (policy.evicts and policy.rank in ranks and not policy.scores_keys and not policy.shared_heads
                and (policy.fold in folds or not policy.needs_scores))

    assert (native_rule(policy) is not None) == known(FOLDS, RANKS)
    assert (c_decode_rule(policy) is not None) == known(C_DECODE_FOLDS, C_DECODE_RANKS)
    assert FOLDS.keys() <= C_DECODE_FOLDS.keys() and RANKS.keys() <= C_DECODE_RANKS.keys()


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
