"""The per-march operator tables: every source row present, spot checks, schema errors, registry."""

from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.common.optable import (
    MARCHES,
    QIR_SECTION,
    OpTable,
    OpTableError,
    Support,
    coverage_markdown,
    fields_markdown,
    generated_block,
    load_table,
    load_table_file,
    parse_table,
    rule_counts,
    torch_spelling,
)
from backends.common.rules import Advisory, Compare, Conditional, Range
from passes import legality_registry

ROOT = Path(__file__).resolve().parents[2]
SEED_ROWS = ROOT / "tests" / "data" / "seed002_operators.txt"


def seed_rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for line in SEED_ROWS.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            section, spelling, b2, bayes = line.split("\t")
            rows.append((section, spelling, b2, bayes))
    return rows


@pytest.fixture(scope="module", params=MARCHES)
def table(request: pytest.FixtureRequest) -> OpTable:
    return load_table(request.param)


# ----------------------------------------------------------------------------- coverage of the source


def test_seed_row_list_is_complete() -> None:
    rows = seed_rows()
    assert len(rows) == 113
    assert len({r[1] for r in rows}) == len(rows)
    per_section: dict[str, int] = {}
    for section, *_ in rows:
        per_section[section] = per_section.get(section, 0) + 1
    assert per_section == {
        "torch_function": 49,
        "torch_nn_functional": 5,
        "torch_nn_module": 33,
        "quant_stub": 2,
        "tensor_method": 21,
        "torchvision": 3,
    }


@pytest.mark.parametrize("march", MARCHES)
def test_every_seed_row_has_its_status(march: str) -> None:
    t = load_table(march)
    col = 2 if march == "bernoulli2" else 3
    for row in seed_rows():
        section, spelling, want = row[0], row[1], row[col]
        e = t.lookup(spelling)
        assert e.section == section, spelling
        if want.startswith("refer:"):
            target = want.removeprefix("refer:")
            if e.support is Support.UNKNOWN:
                assert e.refer_absent == target and target not in t, spelling
            else:
                assert e.refer == target, spelling
                assert e.support == t.lookup(target).support, spelling
        else:
            assert e.refer is None, spelling
            assert e.support.value == want, f"{march} {spelling}: {e.support.value} != {want}"


def test_tables_hold_exactly_the_seed_rows_in_order(table: OpTable) -> None:
    assert [(e.section, e.spelling) for e in table.source_entries()] == [(r[0], r[1]) for r in seed_rows()]
    # qir's own rows come after them, in their own section
    assert [e.spelling for e in table if e.section == QIR_SECTION] == [
        "qir.functional.centered_yuv2rgb",
        "qir.functional.centered_yuv2bgr",
    ]


def test_march_independent_columns_agree() -> None:
    b2, bayes = load_table("bernoulli2"), load_table("bayes")
    for x, y in zip(b2, bayes, strict=True):
        assert (x.spelling, x.section, x.ir_op, x.eager_replacement) == (
            y.spelling,
            y.section,
            y.ir_op,
            y.eager_replacement,
        )


def test_rule_texts_quote_the_source_cells() -> None:
    """Each rule's text is the source's wording: from its constraint cell, or a cell quoted in the note."""
    tables = {m: load_table(m) for m in MARCHES}
    for march, t in tables.items():
        other = tables["bayes" if march == "bernoulli2" else "bernoulli2"]
        for e in t:
            if e.refer is not None:
                continue
            cell = e.constraints
            if cell.startswith("Same as above"):
                cell += " " + other.lookup(e.spelling).constraints
            for r in e.rules:
                assert r.text, f"{march} {e.spelling}: rule without text"
                assert r.text in cell or r.text in e.note, f"{march} {e.spelling}: {r.text!r} not in its cells"


def test_no_constraint_dropped() -> None:
    """A non-empty constraint cell yields at least one rule (checkable or advisory)."""
    for t in map(load_table, MARCHES):
        for e in t:
            if e.refer is None and e.constraints not in ("", "-", "N/A"):
                assert e.rules, f"{t.march} {e.spelling}: constraints {e.constraints!r} have no rules"


# ----------------------------------------------------------------------------- spot checks


def _bound_of(table: OpTable, spelling: str, text: str) -> Any:
    [rule] = [r for r in table.lookup(spelling).rules if r.text == text]
    return rule


def test_bernoulli2_add() -> None:
    e = load_table("bernoulli2").lookup("torch.add")
    assert e.supported and e.input_dtypes == ("qint8", "qint16")
    ok = {"in_channels": 2048, "has_constant_operand": False, "input_dtype": "qint8", "output_dtype": "qint16"}
    assert e.violations(ok) == []
    [v] = e.violations({**ok, "in_channels": 2049})
    assert (v.actual, v.bound) == (2049, 2048)
    [v] = e.violations({**ok, "has_constant_operand": True})
    assert "has_constant_operand" in v.message
    [v] = e.violations({**ok, "input_dtype": "qint32"})
    assert v.actual == "qint32"


def test_bayes_conv2d() -> None:
    e = load_table("bayes").lookup("torch.nn.Conv2d")
    good = {
        "input_dtype": "qint8",
        "output_dtype": "qint8",
        "weight_dtype": "qint8",
        "has_bias": True,
        "bias_dtype": "qint32",
        "is_model_output": False,
        "out_channels": 8192,
        "in_channels": 8192,
        "kernel": (31, 31),
        "dilation": (16, 16),
        "stride": (1, 1),
        "sumin": False,
        "weight_n": 8192,
        "weight_c": 8192,
        "weight_h": 31,
        "weight_w": 31,
        "padding": (256, 256),
    }
    assert e.violations(good) == []
    bad: dict[str, Any] = {
        "out_channels": 8193,
        "in_channels": 8193,
        "kernel": (3, 32),
        "dilation": (17, 1),
        "padding": (0, 257),
    }
    for k, v in bad.items():
        assert e.violations({**good, k: v}), k
    # stride = 1 when dilation != 1, in any dim
    assert e.violations({**good, "dilation": (1, 1), "stride": (2, 2)}) == []
    assert e.violations({**good, "dilation": (2, 1), "stride": (2, 2)})
    assert e.violations({**good, "dilation": (2, 1), "stride": (1, 1)}) == []
    # model outputs may have up to 16384 output channels
    out = {**good, "is_model_output": True, "out_channels": 16384, "weight_n": 16384}
    assert e.violations(out) == []
    assert e.violations({**out, "out_channels": 16385})
    # sumin conv: stride (1, 1) or (2, 2) only
    assert e.violations({**good, "sumin": True, "stride": (2, 2), "dilation": (1, 1)}) == []
    assert e.violations({**good, "sumin": True, "stride": (1, 1), "dilation": (1, 1)}) == []
    assert e.violations({**good, "sumin": True, "stride": (1, 2), "dilation": (1, 1)})
    r = _bound_of(load_table("bayes"), "torch.nn.Conv2d", "stride=1 when dilation!=1")
    assert isinstance(r, Conditional) and str(r) == "stride == 1 when some dilation != 1"


def test_bernoulli2_avg_pool2d() -> None:
    t = load_table("bernoulli2")
    k = _bound_of(t, "torch.nn.AvgPool2d", "1<=kernel<=7")
    s = _bound_of(t, "torch.nn.AvgPool2d", "1<=stride<=185")
    assert isinstance(k, Range) and isinstance(s, Range)
    assert [k.check({"kernel": (x, x)}).ok for x in (0, 1, 7, 8)] == [False, True, True, False]
    assert [s.check({"stride": x}).ok for x in (0, 1, 185, 186)] == [False, True, True, False]


def test_bernoulli2_not_supported_rows() -> None:
    t = load_table("bernoulli2")
    for spelling in ("torch.nn.Linear", "torch.nn.AdaptiveAvgPool2d", "torch.nn.Conv3d", "torch.nn.LayerNorm"):
        e = t.lookup(spelling)
        assert e.support is Support.NOT_SUPPORTED and e.rules == () and e.input_dtypes is None


def test_bayes_linear() -> None:
    e = load_table("bayes").lookup("torch.nn.Linear")
    good = {
        "input_dtype": "qint8",
        "output_dtype": "qint8",
        "weight_dtype": "qint8",
        "has_bias": True,
        "bias_dtype": "qint32",
        "in_features": 8192,
        "out_features": 8192,
    }
    assert e.supported and e.violations(good) == []
    assert len(e.violations({**good, "in_features": 8193, "out_features": 8193})) == 2


def test_bayes_cosh_refers_to_acos() -> None:
    t = load_table("bayes")
    cosh, acos = t.lookup("torch.cosh"), t.lookup("torch.acos")
    assert cosh.refer == "torch.acos" and cosh.supported
    assert (cosh.rules, cosh.input_dtypes, cosh.output_dtypes) == (acos.rules, acos.input_dtypes, acos.output_dtypes)
    assert cosh.eager_replacement == ("qir.nn.Cosh",)
    assert load_table("bernoulli2").lookup("torch.cosh").support is Support.NOT_SUPPORTED


def test_bernoulli2_gelu_refers_to_exp() -> None:
    t = load_table("bernoulli2")
    gelu, exp = t.lookup("torch.nn.GELU"), t.lookup("torch.exp")
    assert gelu.refer == "torch.exp" and gelu.supported and gelu.input_dtypes == ("qint8",)
    assert gelu.rules == exp.rules and all(isinstance(r, Advisory) for r in gelu.rules)
    assert load_table("bayes").lookup("torch.nn.GELU").refer == "torch.acos"


def test_refer_chains_resolve() -> None:
    # torch.Tensor.clip -> torch.Tensor.clamp; torch.minimum -> torch.maximum
    t = load_table("bayes")
    assert t.lookup("torch.Tensor.clip").rules == t.lookup("torch.Tensor.clamp").rules
    assert t.lookup("torch.minimum").input_dtypes == ("qint8", "qint16")


def test_rows_referring_to_absent_rows_are_unknown() -> None:
    for t in map(load_table, MARCHES):
        for s in ("torch.nn.ConstantPad2d", "torch.nn.ReplicationPad2d"):
            e = t.lookup(s)
            assert e.support is Support.UNKNOWN and e.refer_absent == "torch.nn.ZeroPad2d"


def test_bayes_cat_and_interpolate() -> None:
    t = load_table("bayes")
    cat = t.lookup("torch.cat")
    good = {
        "input_dtype": "qint8",
        "output_dtype": "qint8",
        "input_n": 4096,
        "input_h": 16,
        "input_w": 16,
        "input_c": 256,
        "input_count": 2,
    }
    assert cat.violations(good) == []
    assert cat.violations({**good, "input_c": 257})  # H*W*C = 65792
    assert cat.violations({**good, "input_count": 1}) and cat.violations({**good, "input_count": 1025})
    interp = load_table("bernoulli2").lookup("torch.nn.functional.interpolate")
    f = {"input_dtype": "qint8", "output_dtype": "qint8", "mode": "bilinear", "scale_factor": (2.0, 2.0)}
    assert interp.violations(f) == []
    assert interp.violations({**f, "mode": "bicubic"})
    assert interp.violations({**f, "scale_factor": (2.0, 257.0)})


def test_general_notes_kept() -> None:
    assert [type(r) for r in load_table("bernoulli2").general_rules] == [Advisory]
    assert len(load_table("bayes").notes) == 3


def test_rule_counts() -> None:
    for t in map(load_table, MARCHES):
        c = rule_counts(t)
        assert c["checkable"] > 0 and c["advisory"] > 0
    assert rule_counts(load_table("bayes"))["checkable"] > rule_counts(load_table("bernoulli2"))["checkable"]


# ----------------------------------------------------------------------------- lookup and IR names


def test_lookup_by_ir_op(table: OpTable) -> None:
    assert [e.spelling for e in table.by_ir_op("conv2d")] == ["torch.nn.Conv2d"]
    assert {e.spelling for e in table.by_ir_op("batch_norm")} == {
        "torch.nn.BatchNorm2d",
        "torch.nn.BatchNorm3d",
        "torch.nn.SyncBatchNorm",
    }
    assert {e.spelling for e in table.by_ir_op("relu")} == {"torch.nn.functional.relu", "torch.nn.ReLU"}
    for name in ("linear", "add", "avg_pool2d", "adaptive_avg_pool2d", "max_pool2d", "cat", "interpolate"):
        assert table.by_ir_op(name), name
    assert table.by_ir_op("no_such_op") == ()
    with pytest.raises(KeyError, match=r"no row for 'torch\.nn\.Bogus'"):
        table.lookup("torch.nn.Bogus")


def test_ir_op_names_match_the_op_registry(table: OpTable) -> None:
    """Where an IR op class names a torch spelling that the table lists, the table maps it to that op."""
    import qir.ir.ops  # noqa: F401  (registers the ops)
    from qir.ir.op import OP_REGISTRY

    matched = 0
    for name, cls in OP_REGISTRY.items():
        spellings = [torch_spelling(f) for f in cls.functions] + [torch_spelling(m) for m in cls.methods]
        spellings += [torch_spelling(m) for m in getattr(cls, "module_types", ())]
        for s in spellings:
            e = table.get(s)
            if e is not None:
                matched += 1
                assert e.ir_op == name, f"{s}: table says {e.ir_op!r}, IR op class says {name!r}"
    assert matched >= 8


def test_torch_spelling() -> None:
    assert torch_spelling(F.interpolate) == "torch.nn.functional.interpolate"
    assert torch_spelling(nn.Conv2d) == "torch.nn.Conv2d"
    assert torch_spelling(nn.Conv2d(1, 1, 1)) == "torch.nn.Conv2d"
    assert torch_spelling(torch.cat) == "torch.cat"
    assert torch_spelling("reshape") == "torch.Tensor.reshape"
    assert torch_spelling(operator.add) == "torch.add"
    assert torch_spelling(operator.getitem) == "torch.Tensor.getitem"
    assert torch_spelling(torch.ao.quantization.QuantStub) == "torch.quantization.QuantStub"
    assert load_table("bayes").get("torch.ao.quantization.DeQuantStub") is not None


# ----------------------------------------------------------------------------- schema errors


def _minimal(**entry: Any) -> dict[str, Any]:
    return {
        "march": "test",
        "format": 1,
        "sections": [{"id": "s", "title": "S"}],
        "notes": [],
        "general_rules": [],
        "operators": [
            {
                "spelling": "torch.a",
                "section": "s",
                "ir_op": "a",
                "eager_replacement": [],
                "support": "supported",
                "input_dtypes": ["qint8"],
                "output_dtypes": "same_as_input",
                "constraints": "x<=1",
                "rules": [{"field": "input_c", "op": "<=", "value": 1, "text": "x<=1"}],
            },
            {"spelling": "torch.b", "section": "s", "ir_op": None, "eager_replacement": [], **entry},
        ],
    }


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"support": "maybe"}, r"operators\[1\] \(torch.b\) field 'support': expected one of"),
        ({"support": "supported", "refer": "torch.a"}, r"field 'support': give exactly one"),
        ({"support": "supported", "input_dtypes": ["int9"]}, r"field 'input_dtypes'"),
        (
            {"support": "supported", "rules": [{"field": "bogus", "op": "<", "value": 1, "text": "t"}]},
            r"field 'rules\[0\].field': unknown fact 'bogus'",
        ),
        (
            {"support": "supported", "rules": [{"field": "groups", "op": "<<", "value": 1, "text": "t"}]},
            r"field 'rules\[0\].op': unknown operator '<<'",
        ),
        (
            {"support": "supported", "rules": [{"field": "groups", "op": "<", "value": 1}]},
            r"field 'rules\[0\].text': a checkable rule needs",
        ),
        (
            {"support": "supported", "rules": [{"field": "groups", "op": "<", "value": "x", "text": "t"}]},
            r"field 'rules\[0\].value': expected a number",
        ),
        (
            {"support": "supported", "rules": [{"when": {"field": "sumin", "op": "==", "value": True}, "text": "t"}]},
            r"field 'rules\[0\]': a conditional needs both",
        ),
        (
            {"support": "supported", "rules": [{"field": "kernel", "low": 1, "text": "t"}]},
            r"a range needs both 'low' and 'high'",
        ),
        ({"support": "not_supported", "rules": [{"advisory": "x"}]}, r"a not-supported row has no constraints"),
        ({"support": "supported", "colour": "red"}, r"unknown key\(s\) \['colour'\]"),
        ({"support": "supported", "section": "nope"}, r"field 'section'"),
        ({"refer": "torch.zzz"}, r"operators\[1\] \(torch.b\) field 'refer': no row 'torch.zzz'"),
        ({"refer": "torch.b"}, r"reference cycle torch.b -> torch.b"),
        ({"spelling": "torch.a", "support": "supported"}, r"field 'spelling': duplicate of operators\[0\]"),
    ],
)
def test_schema_errors_name_file_row_and_field(entry: dict[str, Any], match: str) -> None:
    with pytest.raises(OpTableError, match=match) as info:
        parse_table(_minimal(**entry), "tables/test.json")
    assert str(info.value).startswith("tables/test.json:")


def test_reference_cycle_across_rows(tmp_path: Path) -> None:
    data = _minimal(refer="torch.c")
    data["operators"].append({"spelling": "torch.c", "section": "s", "refer": "torch.b"})
    p = tmp_path / "ops.json"
    p.write_text(json.dumps(data))
    with pytest.raises(OpTableError, match=r"ops.json: operators\[\d\] \(torch.[bc]\) field 'refer': reference cycle"):
        load_table_file(p)


def test_file_level_errors(tmp_path: Path) -> None:
    p = tmp_path / "ops.json"
    p.write_text("{not json")
    with pytest.raises(OpTableError, match=r"ops.json: line 1 column 2: invalid JSON"):
        load_table_file(p)
    p.write_text(json.dumps(_minimal(support="supported")))
    with pytest.raises(OpTableError, match=r"field 'march': file is for march 'test', expected 'bayes'"):
        load_table_file(p, "bayes")
    with pytest.raises(OpTableError, match="no operator table for march 'zzz'"):
        load_table("zzz")


# ----------------------------------------------------------------------------- registry


def test_registry_loads_backends_lazily() -> None:
    assert legality_registry.get_table("BAYES") is load_table("bayes")
    assert legality_registry.get_table("bernoulli2").march == "bernoulli2"
    assert {"bayes", "bernoulli2"} <= set(legality_registry.available_marches())


def test_registry_errors_and_custom_marches() -> None:
    with pytest.raises(legality_registry.UnknownMarchError, match="no operator table for march 'nomarch'"):
        legality_registry.get_table("nomarch")
    calls: list[int] = []

    def loader() -> OpTable:
        calls.append(1)
        return load_table("bayes")

    legality_registry.register_march_table("testmarch", loader)
    try:
        assert legality_registry.get_table("TestMarch").march == "bayes"
        legality_registry.get_table("testmarch")
        assert calls == [1]
    finally:
        legality_registry._loaders.pop("testmarch", None)
        legality_registry._tables.pop("testmarch", None)
    legality_registry.register_march_plugin("emptymarch", "json")
    try:
        with pytest.raises(legality_registry.UnknownMarchError, match="did not call register_march_table"):
            legality_registry.get_table("emptymarch")
    finally:
        legality_registry._plugins.pop("emptymarch", None)


def test_passes_never_import_backends() -> None:
    text = (ROOT / "passes" / "legality_registry.py").read_text(encoding="utf-8")
    assert "import backends" not in text and "from backends" not in text


# ----------------------------------------------------------------------------- docs


def test_operator_docs_are_up_to_date() -> None:
    doc = (ROOT / "docs" / "operators.md").read_text(encoding="utf-8")
    for name, body in (("coverage", coverage_markdown()), ("fields", fields_markdown())):
        assert generated_block(name, body) in doc, (
            f"docs/operators.md block {name!r} is stale: run python -m backends.common.optable docs/operators.md"
        )


def test_every_rule_uses_documented_facts() -> None:
    doc = (ROOT / "docs" / "operators.md").read_text(encoding="utf-8")
    for t in map(load_table, MARCHES):
        for e in t:
            for r in e.checks():
                for f in r.fields():
                    assert f"`{f}`" in doc, f


def test_rule_kinds_in_tables() -> None:
    kinds = {type(r) for t in map(load_table, MARCHES) for e in t for r in e.rules}
    assert {Compare, Range, Conditional, Advisory} <= kinds
