"""Every policy's declared rule (``decode_rule()``, ``scores_keys``, ``ranks_upfront``) is what its
hooks compute: the native C and Triton steps run a policy by its declaration alone
(``core/native/rules.py``), so a declaration that lies would run the wrong rule there. Nothing is
inferred from which hooks a class overrides: a class that overrides one declares its rule where
it does (``undeclared_hooks``), or a subclass would run its parent's rule in the kernels."""

from types import SimpleNamespace

import pytest
import torch

from h2okv.core.native.rules import (
    ACC_REPLACE,
    C_DECODE_FOLDS,
    C_DECODE_RANKS,
    FOLDS,
    KEY_SCORE,
    RANKS,
    c_decode_rule,
    native_rule,
)
from h2okv.core.reconstruction import rank_by_probes
from h2okv.errors import H2OError
from h2okv.policies import POLICIES, H2OPolicy, Policy, ReconstructionPolicy, ScoreRule, make_policy

# what each declared rule means, written out (the kernels compute these and nothing else)
FOLD_RULES = {"add": lambda score, mass, rule: score + mass, "replace": lambda score, mass, rule: mass.clone(),
              "decay": lambda score, mass, rule: rule.decay * score + mass}
RANK_RULES = {"score": lambda score, ordinal, n, keys, rule: score,
              "mean": lambda score, ordinal, n, keys, rule: score / (n - ordinal).clamp(min=1),
              "ordinal": lambda score, ordinal, n, keys, rule: ordinal.float(),
              "rkv": lambda score, ordinal, n, keys, rule: rkv_rule(score, keys, rule.weight)}
# a value other than the default for every option of every policy: each is tested alone below, so
# an option that changes a policy's rule is held to its hooks too (a new option needs one here)
OTHER_VALUES = {"decay": 0.8, "weight": 0.5, "kernel": 3, "copies": 0.5, "window": 8, "pool": "max", "chunk": 4,
                "future": 16, "sinks": 2, "tail": 0, "question": 4, "tail_in_budget": 1, "heads": "shared",
                "question_kernel": 5, "local": 1, "words": 1, "ceiling": 2,
                "probe_upto": "16,question=4",  # probe_upto needs the question it then ranks by
                "question_share": "0.5,question=4"}  # so does the share it reserves
# a policy's option that needs others beside it (kvzip spans words past probe_upto only)
OTHER_FOR = {("kvzip", "words"): "1,question=4,probe_upto=16"}
SPECS = [*sorted(POLICIES),
         *(f"{name}:{opt.name}={OTHER_FOR.get((name, opt.name), OTHER_VALUES[opt.name])}"
           for name, cls in sorted(POLICIES.items()) for opt in cls.options() if opt.name in OTHER_VALUES),
         "rkv:weight=0.5,decay=0.7"]
HOOKS = ("accumulate", "eviction_key")  # the hooks a ScoreRule stands for


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


def undeclared_hooks(cls) -> list[str]:
    """The hooks ``cls`` computes with a class below the one that wrote its ``decode_rule``: that
    rule was declared for other hooks (a subclass of ``h2o`` that halves the mass would run "add")."""
    mro = cls.__mro__

    def written_at(name):
        return mro.index(next(c for c in mro if name in vars(c)))

    return [hook for hook in HOOKS if written_at(hook) < written_at("decode_rule")]


def test_every_option_of_every_policy_is_held_to_its_rule():
    assert {opt.name for cls in POLICIES.values() for opt in cls.options()} <= OTHER_VALUES.keys()
    assert FOLD_RULES.keys() == C_DECODE_FOLDS.keys() and RANK_RULES.keys() == C_DECODE_RANKS.keys()


@pytest.mark.parametrize("name", SPECS)
def test_the_hooks_compute_the_declared_rule(name):
    policy = make_policy(name)
    rule = policy.decode_rule()
    score, ordinal, n_real = random_state()
    if rule is not None:
        assert (rule.fold is None) == (not policy.needs_scores)  # a fold exactly where mass arrives
        if rule.fold is not None:
            mass = torch.rand_like(score)
            folded = score.clone()
            policy.accumulate(folded, mass)
            torch.testing.assert_close(folded, FOLD_RULES[rule.fold](score, mass, rule))
        keys = torch.randn(*score.shape, 8, generator=torch.Generator().manual_seed(1))
        by_keys = {"keys": keys, "valid": torch.ones_like(score, dtype=torch.bool)} if policy.ranks_by_keys else {}
        torch.testing.assert_close(policy.eviction_key(score, ordinal, n_real, **by_keys).float(),
                                   RANK_RULES[rule.rank](score, ordinal, n_real, keys, rule).float())
    keys = torch.randn(2, 3, 5, 8)
    assert policy.scores_keys == (policy.key_scores(keys) is not None)
    assert policy.ranks_upfront == (type(policy).prefill_scores is not Policy.prefill_scores)


@pytest.mark.parametrize("name", SPECS)
def test_a_policy_that_overrides_a_hook_declares_its_rule_with_it(name):
    """A rule the kernels would run is written no higher in the class tree than its hooks."""
    policy = make_policy(name)
    if policy.decode_rule() is not None:
        assert undeclared_hooks(type(policy)) == []


@pytest.mark.parametrize("name", SPECS)
def test_a_policy_runs_natively_exactly_when_its_rule_is_declared_and_known(name):
    """The scan and Triton know FOLDS and RANKS; the C decode step those and "decay", "rkv"."""
    policy = make_policy(name)
    rule = policy.decode_rule()

    def known(folds, ranks):
        return (rule is not None and policy.evicts and rule.rank in ranks and not policy.scores_keys
                and not policy.shared_heads and (rule.fold in folds or not policy.needs_scores))

    assert (native_rule(policy) is not None) == known(FOLDS, RANKS)
    decode = c_decode_rule(policy)
    assert (decode is not None) == known(C_DECODE_FOLDS, C_DECODE_RANKS)
    if decode is not None:  # the C and Triton steps read the declared numbers
        assert (decode.decay, decode.weight) == (rule.decay, rule.weight)
    assert FOLDS.keys() <= C_DECODE_FOLDS.keys() and RANKS.keys() <= C_DECODE_RANKS.keys()


def test_a_subclass_that_overrides_a_hook_and_inherits_the_rule_is_refused():
    # nothing is inferred: Halved would run h2o's "add" in the kernels, so defining it is an error
    with pytest.raises(TypeError, match="Halved overrides accumulate: declare its decode_rule"):
        class Halved(H2OPolicy):
            def accumulate(self, score, mass):
                score.add_(mass / 2)

    with pytest.raises(TypeError, match="Fresh overrides eviction_key"):
        class Fresh(H2OPolicy):
            def eviction_key(self, score, ordinal, n_real, layer_idx=0):
                return -score

    class Declared(H2OPolicy):
        def decode_rule(self):
            return ScoreRule(fold="replace", rank="score")

        def accumulate(self, score, mass):
            score.copy_(mass)

    class Eager(H2OPolicy):
        def decode_rule(self):
            return None  # the tensor-op step runs the hooks

        def accumulate(self, score, mass):
            score.add_(mass / 2)

    class Inherits(Declared):  # takes its parent's hooks and rule together
        pass

    assert undeclared_hooks(Declared) == [] and native_rule(Declared()) == (ACC_REPLACE, KEY_SCORE)
    assert undeclared_hooks(Eager) == [] and native_rule(Eager()) is None and c_decode_rule(Eager()) is None
    assert native_rule(Inherits()) == (ACC_REPLACE, KEY_SCORE)
    assert undeclared_hooks(H2OPolicy) == []  # the parents keep theirs


def test_only_reconstruction_policies_carry_the_probe_hooks():
    for cls in POLICIES.values():
        assert cls.ranks_by_reconstruction == issubclass(cls, ReconstructionPolicy)
        if not cls.ranks_by_reconstruction:
            assert not any(hasattr(cls, m) for m in ("smooth_probe", "question_scores", "question", "tail",
                                                     "tail_in_budget"))
            assert make_policy(cls.name).slots_above_budget == 0
    # kvzip's tail is held on top of the budget (the server reserves it), unless it counts inside
    assert make_policy("kvzip:tail=12").slots_above_budget == 12
    assert make_policy("kvzip:tail=12,tail_in_budget=1").slots_above_budget == 0
    # the core asks those hooks only of such a policy: the pass refuses any other before it starts
    with pytest.raises(H2OError, match="ranks by reconstruction"):
        rank_by_probes(None, SimpleNamespace(policy=make_policy("h2o"), layers=[]), [])
