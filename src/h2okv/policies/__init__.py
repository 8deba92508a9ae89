"""Eviction policies, one small module each, and ``make_policy`` which builds one from its name.

A name may carry options after a colon: ``snapkv:window=16`` (or ``snapkv:16`` for the first
option); the ranking policies take ``heads=shared`` (``tova:heads=shared``), one kept set per layer. Every command that takes ``--policy``/``--policies`` accepts these names.
"""

from __future__ import annotations

from h2okv.errors import H2OError
from h2okv.policies.base import HEADS_CHOICES, Budget, Policy, ScoreRule
from h2okv.policies.expected import ExpectedAttentionPolicy
from h2okv.policies.full import FullPolicy
from h2okv.policies.h2o import H2OPolicy
from h2okv.policies.h2o_mean import H2OMeanPolicy
from h2okv.policies.h2o_sink import H2OSinkPolicy
from h2okv.policies.knorm import KnormPolicy
from h2okv.policies.kvzip import KVzipPolicy
from h2okv.policies.local import LocalPolicy
from h2okv.policies.random import RandomPolicy
from h2okv.policies.reconstruction import ReconstructionPolicy
from h2okv.policies.rkv import RKVPolicy
from h2okv.policies.sink import SinkPolicy
from h2okv.policies.snapkv import SnapKVPolicy
from h2okv.policies.tova import TOVAPolicy
from h2okv.policy_names import POLICY_NAMES, RECONSTRUCTION_POLICIES

_CLASSES = {
    cls.name: cls
    for cls in (
        FullPolicy, H2OPolicy, LocalPolicy, SinkPolicy, RandomPolicy,
        TOVAPolicy, H2OSinkPolicy, H2OMeanPolicy, SnapKVPolicy, KnormPolicy, RKVPolicy, ExpectedAttentionPolicy,
        KVzipPolicy,
    )
}
if set(_CLASSES) != set(POLICY_NAMES):  # the torch-free name list the CLI's help shows must match
    raise ImportError(f"h2okv.policy_names lists {POLICY_NAMES}, the policy classes are {tuple(_CLASSES)}")
POLICIES: dict[str, type[Policy]] = {name: _CLASSES[name] for name in POLICY_NAMES}
if {n for n, c in _CLASSES.items() if c.ranks_by_reconstruction} != set(RECONSTRUCTION_POLICIES):
    raise ImportError(f"h2okv.policy_names.RECONSTRUCTION_POLICIES is {RECONSTRUCTION_POLICIES}, out of step with the classes")


def refuse_reconstruction(spec: str, where: str) -> None:
    """A one-line error for a policy that needs ``h2okv.reconstruct``'s pass in a ``where`` that does
    not run it (a cache it never ranks would hold the whole prompt and pass for the policy)."""
    if policy_class(spec).ranks_by_reconstruction:
        raise H2OError(f"policy {spec!r} ranks a prompt by reconstructing it, which {where} does not run; "
                       f"use `h2okv eval longctx` or h2okv.reconstruct() in Python")


def parse_policy_spec(spec: str) -> tuple[type[Policy], dict]:
    """``"snapkv:window=16"`` -> (SnapKVPolicy, {"window": 16}); one-line errors for bad specs. The
    values are read by the options' types; the policy checks them when it is built."""
    name, _, rest = str(spec).strip().partition(":")
    cls = POLICIES.get(name.strip())
    if cls is None:
        raise H2OError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    declared = {opt.name: opt for opt in cls.options()}
    options: dict = {}
    for i, part in enumerate(p.strip() for p in rest.split(",") if p.strip()) if rest else []:
        key, eq, value = part.partition("=")
        if not eq:  # positional: the policy's first option
            if i or not declared:
                raise H2OError(f"policy {name!r}: cannot read option {part!r}; write NAME=VALUE")
            # ``h2o:shared``: a heads choice names itself, whatever the policy declares first
            key = "heads" if "heads" in declared and part in HEADS_CHOICES else next(iter(declared))
            value = part
        key = key.strip()
        options[key] = known_option(cls, key).read(cls.name, value)
    return cls, options


def known_option(cls: type[Policy], key: str):
    """``cls``'s option ``key``, or the one-line error that lists the options it has."""
    for opt in cls.options():
        if opt.name == key:
            return opt
    names = [opt.name for opt in cls.options()]
    raise H2OError(f"policy {cls.name!r} has no option {key!r}" + (f"; it has {', '.join(names)}" if names else ""))


def policy_class(spec: str) -> type[Policy]:
    """The class behind a policy spec (e.g. to ask ``.evicts`` without building one)."""
    return parse_policy_spec(spec)[0]


def make_policy(spec: str | Policy, seed: int = 0, **options) -> Policy:
    """The policy ``spec`` names (a ``Policy`` as it is), with ``options`` given as Python values
    over the spec's: ``make_policy("snapkv", window=16)`` is ``SnapKVPolicy(window=16)``, checked alike."""
    if isinstance(spec, Policy):
        return spec
    cls, parsed = parse_policy_spec(spec)
    for key in options:
        known_option(cls, key)
    return cls(seed=seed, **{**parsed, **options})


__all__ = ["Budget", "POLICIES", "Policy", "ReconstructionPolicy", "ScoreRule", "make_policy", "parse_policy_spec",
           "policy_class", "refuse_reconstruction"]
