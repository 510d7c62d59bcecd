"""Pipeline text: parse, print, canonical round trip, typed options, error messages, registry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import ClassVar

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from manager_fixtures import Boom, CountOps, Flavour, Level, ObjectOption, Options, Required

import passes
from passes import Pass, PassContext, Pipeline, PipelineError, format_pipeline, parse_pipeline, register_pass
from passes.describe import describe_passes
from passes.registry import BUILTIN_PASSES, available_passes, get_pass_class
from qir.ir import Graph

CANONICAL = [
    "",
    "dce",
    "dce,remove-identity,dce",
    "pm-options{n=4}",
    "pm-options{x=1e-05 flag=true label=my.label/x:y}",
    'pm-options{label="two words" note="none"}',
    "pm-options{flavour=sour-ish level=HIGH mode=7}",
    "pm-options{mode=exact limit=-2 note=hello either=5}",
    'pm-options{either="5"}',
    "pm-options{ops=[conv2d] sizes=[1,2,3] pair=[0,-1.5] nested=[[1,2],[]]}",
    "pm-options{ops=[]}",
    "pm-options{names=a}",
    "pm-options{names=[a]}",
    'pm-boom{message="a,b{c}=[d] \\"q\\" \\\\ \\n"}',
    "pm-required{level=0},pm-count-ops",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_text_round_trips(text: str) -> None:
    assert str(parse_pipeline(text)) == text
    assert format_pipeline(parse_pipeline(text)) == text


def test_parse_builds_typed_instances() -> None:
    p = parse_pipeline("pm-options{n=4 flavour=sour-ish level=HIGH ops=[a,b] pair=[2,3] limit=none}, dce")
    assert len(p) == 2
    opts = p[0]
    assert isinstance(opts, Options)
    assert opts == Options(n=4, flavour=Flavour.SOUR, level=Level.HIGH, ops=("a", "b"), pair=(2, 3.0))
    assert isinstance(opts.pair[1], float)
    assert type(p[1]).name == "dce"


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("  dce ,  pm-count-ops  ", "dce,pm-count-ops"),
        ("pm-options{n=3 x=0.5 ops=[conv2d,linear]}", "pm-options"),  # defaults are left out
        ("pm-options{ flag , n=4 }", "pm-options{n=4 flag=true}"),  # bare flag; comma separator
        ("pm-options{max-iters=2}", "pm-options{max_iters=2}"),  # dashes stand for underscores
        ("pm-options{ops=conv2d}", "pm-options{ops=[conv2d]}"),  # a lone value is a 1-list
        ('pm-options{label="plain2" x=1}', "pm-options{x=1.0 label=plain2}"),
        ("pm-options{flavour=SOUR}", "pm-options{flavour=sour-ish}"),  # enum by name too
        ("pm-options {n=4}", "pm-options{n=4}"),
        ("dce,\n  pm-count-ops", "dce,pm-count-ops"),
    ],
)
def test_text_normalises(text: str, canonical: str) -> None:
    assert str(parse_pipeline(text)) == canonical


def test_pipeline_object() -> None:
    p = Pipeline.parse("dce,pm-count-ops")
    assert list(p) == [get_pass_class("dce")(), CountOps()]
    assert str(p[1:]) == "pm-count-ops"
    assert str(p + "remove-identity") == "dce,pm-count-ops,remove-identity"
    extra = [Boom(message="x")]
    assert str(p + extra) == "dce,pm-count-ops,pm-boom{message=x}"
    assert str(Options(x=2)) == "pm-options{x=2.0}"


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("dce,fusee", ["unknown pass 'fusee'", "did you mean 'fuse'", "available passes:", "dce", "pm-options", "^"]),
        ("pm-options{nn=1}", ["pass 'pm-options' has no option 'nn'", "did you mean 'n'", "max_iters: int = 10"]),
        ("dce{x=1}", ["pass 'dce' has no option 'x'", "takes no options"]),
        ("pm-options{n=abc}", ["option 'n' of pass 'pm-options': expected int, got abc"]),
        ("pm-options{n=1.5}", ["expected int, got 1.5"]),
        ('pm-options{n="3"}', ['expected int, got the string "3"']),
        ("pm-options{flag=yes}", ["expected bool, got yes"]),
        ("pm-options{flavour=salty}", ["expected one of sweet, sour-ish, got salty"]),
        ("pm-options{level=3}", ["expected one of LOW, HIGH"]),
        ("pm-options{mode=slow}", ["expected one of fast, exact, 7"]),
        ("pm-options{pair=[1]}", ["expected 2 values [int, float], got 1"]),
        ("pm-options{sizes=[1,x]}", ["expected int, got x"]),
        ("pm-options{n=[1]}", ["expected int, got a list [1]"]),
        ("pm-options{n=1 n=2}", ["option 'n' of pass 'pm-options' is given twice"]),
        ("pm-options{n}", ["option 'n' of pass 'pm-options' needs a value: n=<int>"]),
        ("pm-required", ["pass 'pm-required' needs option(s) level=<int>"]),
        ("pm-opaque{table=x}", ["cannot express", "ObjectOption(table=...)"]),
        ("dce,", ["bad pipeline: expected a pass name, found the end"]),
        ("dce pm-count-ops", ["expected ',' between passes, found 'p'"]),
        ("pm-options{n=1", ["'{' of pass 'pm-options' is never closed"]),
        ("pm-options{n=}", ["expected a value, found '}'", "quote values"]),
        ("pm-options{sizes=[1,2}", ["expected ',' or ']' in the list opened here"]),
        ('pm-options{label="abc}', ["string is never closed"]),
        ('pm-options{label="\\q"}', ["bad string"]),
        ("pm-options{n=1x=2}", ["expected ' ', ',' or '}' after option 'n', found '='"]),
        ('pm-options{label="a"n=2}', ["expected ' ', ',' or '}' after option 'label'"]),
    ],
)
def test_errors_name_the_problem(text: str, fragments: list[str]) -> None:
    with pytest.raises(PipelineError) as info:
        parse_pipeline(text)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_error_points_at_the_spot() -> None:
    with pytest.raises(PipelineError) as info:
        parse_pipeline("dce,pm-options{n=4 flavour=salty}")
    lines = str(info.value).splitlines()
    assert lines[0].endswith("(column 28)")
    assert lines[1] == "  dce,pm-options{n=4 flavour=salty}"
    assert lines[2].index("^") == lines[1].index("salty")


def test_constructor_validation_becomes_pipeline_error() -> None:
    with pytest.raises(PipelineError, match=r"pass 'pm-checked' rejected its options: .*positive"):
        parse_pipeline("pm-checked{n=-1}")


@register_pass
@attrs.frozen
class Checked(Pass):
    name: ClassVar[str] = "pm-checked"
    n: int = attrs.field(default=1)

    @n.validator
    def _positive(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value <= 0:
            raise ValueError(f"n must be positive, got {value}")

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        return False


def test_printing_objects_strict_and_lenient() -> None:
    p = ObjectOption(table={"a": 1})
    assert str(p) == "pm-opaque{table=<{'a': 1}>}"  # fine in messages
    with pytest.raises(PipelineError, match="cannot print option 'table' of pass 'pm-opaque'"):
        format_pipeline([p])
    assert format_pipeline([ObjectOption()]) == "pm-opaque"  # at its default: nothing to print


# --------------------------------------------------------------------------- property tests

_ints = st.integers(-(10**12), 10**12)
_floats = st.floats(allow_nan=False)
_options = st.builds(
    Options,
    n=_ints,
    x=_floats,
    flag=st.booleans(),
    label=st.text(),
    flavour=st.sampled_from(Flavour),
    level=st.sampled_from(Level),
    mode=st.sampled_from(["fast", "exact", 7]),
    limit=st.none() | _ints,
    note=st.none() | st.text(),
    either=_ints | st.text(),
    ops=st.lists(st.text(), max_size=4).map(tuple),
    sizes=st.lists(_ints, max_size=4),
    pair=st.tuples(_ints, _floats),
    nested=st.lists(st.lists(_ints, max_size=3).map(tuple), max_size=3).map(tuple),
    names=st.lists(st.text(), max_size=3).map(tuple) | st.text(),
    max_iters=_ints,
)
_passes = st.one_of(
    _options,
    st.builds(Boom, message=st.text()),
    st.builds(Required, level=_ints),
    st.just(CountOps()),
    st.sampled_from(["dce", "remove-identity"]).map(lambda n: get_pass_class(n)()),
)


@given(st.lists(_passes, max_size=5))
def test_print_parse_print_is_stable(pipeline: list[Pass]) -> None:
    text = format_pipeline(pipeline)
    again = parse_pipeline(text)
    assert list(again) == pipeline
    assert format_pipeline(again) == text


@given(st.text(alphabet='dcepm-{}[]=," ab1\\ ', max_size=30))
def test_any_text_parses_or_raises_pipeline_error(text: str) -> None:
    try:
        parse_pipeline(text)
    except PipelineError:
        pass


# --------------------------------------------------------------------------- registry


def test_import_is_lazy_and_names_load_on_use() -> None:
    code = (
        "import sys, passes\n"
        "assert not [m for m in sys.modules if m in passes.BUILTIN_PASSES.values()], 'eager pass import'\n"
        "passes.parse_pipeline('dce')\n"
        "assert 'passes.dce' in sys.modules and 'passes.remove_identity' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", sorted(BUILTIN_PASSES))
def test_builtin_table_entries_register_their_name(name: str) -> None:
    if importlib.util.find_spec(BUILTIN_PASSES[name]) is None:
        pytest.skip(f"{BUILTIN_PASSES[name]} is not written yet")
    cls = get_pass_class(name)
    assert cls.name == name and cls.__module__ == BUILTIN_PASSES[name]
    assert str(parse_pipeline(name)) == name


def test_missing_builtin_module_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BUILTIN_PASSES, "pm-missing", "passes.pm_no_such_module")
    assert "pm-missing" in available_passes()
    with pytest.raises(PipelineError, match=r"its module passes.pm_no_such_module does not exist"):
        parse_pipeline("pm-missing")


def test_builtin_names_are_reserved() -> None:
    with pytest.raises(ValueError, match=r"'dce' is reserved for the built-in pass in passes.dce"):

        @register_pass
        @attrs.frozen
        class MyDce(Pass):
            name: ClassVar[str] = "dce"

    assert get_pass_class("dce").__module__ == "passes.dce"


def test_taken_names_are_refused_but_redefinition_replaces() -> None:
    def define(tag: int) -> type[Pass]:
        @attrs.frozen
        class Again(Pass):
            name: ClassVar[str] = "pm-again"
            value: ClassVar[int] = tag

        return register_pass(Again)

    first, second = define(1), define(2)  # same module and qualname: a re-run definition
    assert get_pass_class("pm-again") is second is not first

    @attrs.frozen
    class Other(Pass):
        name: ClassVar[str] = "pm-again"

    with pytest.raises(ValueError, match=r"'pm-again' is taken by .*Again; give .*Other another name"):
        register_pass(Other)


def test_describe_passes_lists_options() -> None:
    text = describe_passes()
    assert "dce " in text and "remove unused pure nodes" in text
    assert "pm-options{n: int = 3, x: float = 0.5" in text
    assert "pm-required{level: int (required)}" in text


def test_package_exports() -> None:
    for name in passes.__all__:
        assert hasattr(passes, name), name
