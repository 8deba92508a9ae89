"""A policy's options are its dataclass fields (``policies/base.py``: ``option``): the spec parser,
``spec``, the keywords a class takes and every error read them there, so each is declared once."""

import dataclasses
import re
from pathlib import Path

import pytest

from h2okv.errors import H2OError
from h2okv.policies import POLICIES, Policy, make_policy, parse_policy_spec
from h2okv.policies.base import heads_option, option
from h2okv.policies.h2o import H2OPolicy, HeavyHitters, decay_option

# each option's order per policy: a spec writes them in this order, so recorded rows (keyed by the
# spec) are found again only while it holds (a dataclass puts inherited fields first)
ORDER = {"full": (), "h2o": ("decay", "heads"), "local": (), "sink": (), "random": (), "tova": ("heads",),
         "h2o-sink": ("decay", "heads"), "h2o-mean": ("decay", "heads"),
         "snapkv": ("window", "kernel", "pool", "chunk", "decay", "words", "heads"), "knorm": ("heads",),
         "rkv": ("weight", "decay", "kernel", "copies", "heads"), "expected": ("future", "sinks", "heads"),
         "kvzip": ("kernel", "tail", "question", "tail_in_budget", "probe_upto", "question_kernel", "local",
                   "words", "ceiling", "question_share", "heads")}
# a valid value other than the default, and one its check refuses, for every option
OTHER = {"decay": 0.75, "heads": "shared", "window": 8, "kernel": 3, "pool": "max", "chunk": 4, "weight": 0.5,
         "copies": 0.5, "future": 16, "sinks": 2, "tail": 12, "question": 4, "tail_in_budget": 1, "probe_upto": 4096,
         "question_kernel": 31, "local": 1, "words": 1, "ceiling": 2.5, "question_share": 0.5}
REFUSED = {"decay": 0.0, "heads": "all", "window": 0, "kernel": 4, "pool": "mean", "chunk": -1, "weight": 1.5,
           "copies": 1.0, "future": 0, "sinks": -1, "tail": -1, "question": -2, "tail_in_budget": 2, "probe_upto": -1,
           "question_kernel": 2, "local": 2, "words": 2, "ceiling": 0.5, "question_share": 1.5}
# what an option is given beside it, where it means nothing alone (kvzip ranks a prompt past probe_upto
# by its question's attention, and spans words there only)
NEEDS = {("kvzip", "probe_upto"): {"question": 4}, ("kvzip", "question_share"): {"question": 4}, ("kvzip", "words"): {"question": 4, "probe_upto": 16}}
EACH_OPTION = [(name, opt) for name, cls in POLICIES.items() for opt in cls.options()]


def values(policy: Policy) -> dict:
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}


def test_every_policy_declares_its_options_in_the_recorded_order():
    assert {name: tuple(opt.name for opt in cls.options()) for name, cls in POLICIES.items()} == ORDER
    assert {opt.name for _, opt in EACH_OPTION} == OTHER.keys() == REFUSED.keys()


@pytest.mark.parametrize("name", POLICIES)
def test_defaults_come_from_the_fields(name):
    cls = POLICIES[name]
    policy = make_policy(name)
    declared = {f.name: f.default for f in dataclasses.fields(cls) if "option" in f.metadata}
    assert {opt.name: opt.default for opt in cls.options()} == declared
    assert values(policy) == values(cls()) == {"seed": 0, **declared}
    # a default spec writes exactly the options shown always, at their defaults
    shown = [f"{opt.name}={opt.default}" for opt in cls.options() if opt.shown]
    assert policy.spec == (f"{name}:{','.join(shown)}" if shown else name)


@pytest.mark.parametrize("name, opt", EACH_OPTION, ids=[f"{n}-{o.name}" for n, o in EACH_OPTION])
def test_a_spec_round_trips_with_each_option_changed(name, opt):
    cls = POLICIES[name]
    needs = NEEDS.get((name, opt.name), {})
    by_spec = make_policy(",".join([f"{name}:{opt.name}={OTHER[opt.name]}", *(f"{k}={v}" for k, v in needs.items())]))
    by_keyword = cls(**{opt.name: OTHER[opt.name]}, **needs)
    assert getattr(by_spec, opt.name) == OTHER[opt.name] != opt.default
    assert f"{opt.name}={OTHER[opt.name]}" in by_spec.spec.split(":")[1].split(",")
    for policy in (by_spec, by_keyword):
        again = make_policy(policy.spec)
        assert type(again) is cls and again.spec == policy.spec and values(again) == values(policy)
    assert by_spec.shared_heads == (opt.name == "heads")


@pytest.mark.parametrize("name", POLICIES)
def test_a_spec_with_every_option_changed_round_trips(name):
    cls = POLICIES[name]
    changed = {opt.name: OTHER[opt.name] for opt in cls.options()}
    policy = cls(**changed)
    assert make_policy(policy.spec).spec == policy.spec
    assert values(make_policy(policy.spec)) == values(policy) == {"seed": 0, **changed}
    assert parse_policy_spec(policy.spec) == (cls, changed)


@pytest.mark.parametrize("name, opt", EACH_OPTION, ids=[f"{n}-{o.name}" for n, o in EACH_OPTION])
def test_a_refused_value_is_one_line_naming_the_policy_and_the_option(name, opt):
    bad = REFUSED[opt.name]
    message = f"{name} {opt.name} must be {opt.must_be}, got {bad!r}"
    for build in (lambda: make_policy(f"{name}:{opt.name}={bad}"), lambda: POLICIES[name](**{opt.name: bad}),
                  lambda: make_policy(name, **{opt.name: bad})):
        with pytest.raises(H2OError) as caught:
            build()
        assert str(caught.value) == message and "\n" not in message


@pytest.mark.parametrize("name, key, text, value, kind", [
    ("snapkv", "window", "abc", "16", "int"), ("rkv", "weight", "heavy", "0.5", "float"),
    ("snapkv", "window", None, 16.5, "int"), ("snapkv", "kernel", None, True, "int"), ("snapkv", "pool", None, 3, "str"),
])
def test_a_value_of_another_type_is_refused_alike_from_a_spec_and_from_python(name, key, text, value, kind):
    builds = [(lambda: POLICIES[name](**{key: value}), value)]  # Python's text is not read: a str is no int
    if text is not None:
        builds.append((lambda: make_policy(f"{name}:{key}={text}"), text))
    for build, given in builds:
        with pytest.raises(H2OError) as caught:
            build()
        assert str(caught.value) == f"policy {name!r}: option {key}={given!r} is not a {kind}"


def test_python_keywords_are_typed_and_checked_as_a_spec_is():
    rkv = POLICIES["rkv"](weight=1)  # an int where a float is asked is that float
    assert rkv.weight == 1.0 and type(rkv.weight) is float and rkv.spec == make_policy("rkv:weight=1").spec
    snapkv = POLICIES["snapkv"](16, 3)  # positional: in the order of the fields, as ``snapkv:16``
    assert snapkv.spec == "snapkv:window=16,kernel=3" and make_policy("snapkv:16").window == 16
    assert make_policy("snapkv", window=16, pool="max").spec == POLICIES["snapkv"](window=16, pool="max").spec
    assert make_policy("snapkv:window=8", window=16).window == 16  # the keyword over the spec
    assert make_policy("random", seed=3).seed == 3 and make_policy("random:").spec == "random"
    with pytest.raises(H2OError, match="^policy 'snapkv' has no option 'span'; it has window, kernel, pool"):
        make_policy("snapkv", span=3)
    with pytest.raises(TypeError):  # the class itself takes its fields and nothing else
        POLICIES["snapkv"](span=3)


def test_a_new_policys_options_are_read_from_its_fields():
    @dataclasses.dataclass(eq=False)
    class Widened(HeavyHitters):  # h2o's hooks, its own options in its own order
        name = "widened"
        width: int = option(5, check=lambda v: v >= 2, must_be="at least 2")
        mode: str = option("a", choices=("a", "b", "c"), shown=False)
        decay: float = decay_option()
        heads: str = heads_option()

    assert [opt.name for opt in Widened.options()] == ["width", "mode", "decay", "heads"]
    assert Widened().spec == "widened:width=5" and Widened(mode="c", heads="shared").spec == \
        "widened:width=5,mode=c,heads=shared"
    assert Widened(9, decay=0.5).decode_rule().decay == 0.5
    assert Widened(heads="shared").shared_heads and not Widened().shared_heads
    with pytest.raises(H2OError, match=r"^widened width must be at least 2, got 1$"):
        Widened(width=1)
    with pytest.raises(H2OError, match=r"^widened mode must be a, b or c, got 'd'$"):
        Widened(mode="d")


def test_a_declaration_that_would_not_work_is_refused():
    class Undecorated(H2OPolicy):  # its field would be a class attribute holding a Field
        width: int = option(5, check=lambda v: v >= 2, must_be="at least 2")

    @dataclasses.dataclass
    class ByValue(H2OPolicy):  # eq=True: unhashable, where a policy is one object
        width: int = option(5, check=lambda v: v >= 2, must_be="at least 2")

    @dataclasses.dataclass(eq=False)
    class Listed(H2OPolicy):
        widths: list = option((), check=lambda v: True, must_be="anything")

    @dataclasses.dataclass(eq=False)
    class Typo(H2OPolicy):
        width: int = option(1, check=lambda v: v >= 2, must_be="at least 2")

    for cls, message in ((Undecorated, "decorate it with @dataclass"), (ByValue, "eq=False"),
                         (Listed, "an int, a float or a str"), (Typo, "width must be at least 2, got 1")):
        with pytest.raises((TypeError, H2OError), match=message):
            cls()
    with pytest.raises(TypeError, match="says what a value must be"):
        option(1)


def test_the_library_guides_table_lists_each_policys_options_and_defaults():
    """docs/guides/library.md's policy table, row by row: the options the fields declare, in their
    order, each default it gives equal to the field's (the table is written by hand)."""
    guide = (Path(__file__).parents[2] / "docs" / "guides" / "library.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([\w-]+)` \| .* \| (.*) \|$", guide, re.M) if m[1] in POLICIES}
    assert rows.keys() == POLICIES.keys()
    for name, column in rows.items():
        listed = re.findall(r"`(\w+)`(?: \(([^),:]+))?", column)
        assert [key for key, _ in listed] == list(ORDER[name]), name
        defaults = {opt.name: opt.default for opt in POLICIES[name].options()}
        for key, given in listed:
            if given:
                assert type(defaults[key])(given) == defaults[key], (name, key, given)
