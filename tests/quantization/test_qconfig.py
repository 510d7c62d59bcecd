"""QConfig: the seeds' custom qconfig snippets, named defaults, kinds, and argument hygiene."""

from __future__ import annotations

import copy
import pickle
import textwrap

import pytest
import torch

import qir
import qir.qconfig
from qir.quantization import (
    CalibFakeQuantize,
    FakeQuantize,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    PercentileObserver,
    QConfig,
    default_calib_8bit_fake_quant_qconfig,
    default_calib_16bit_fake_quant_qconfig,
    default_qat_8bit_fake_quant_qconfig,
    default_qat_8bit_weight_32bit_out_fake_quant_qconfig,
    default_qat_16bit_fake_quant_qconfig,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    qconfig_kind,
)


def build(factory: object) -> FakeQuantize:
    """Call a qconfig factory and check it built a FakeQuantize (typed for the assertions below)."""
    assert callable(factory)
    module = factory()
    assert isinstance(module, FakeQuantize)
    return module


def averaging(fq: FakeQuantize) -> float:
    assert isinstance(fq.observer, (MovingAveragePerTensorMinMaxObserver, MovingAveragePerChannelMinMaxObserver))
    return fq.observer.averaging_constant


# The seeds' "Customizing qconfig" snippets, with horizon_plugin_pytorch imports spelled qir.
SEED_SNIPPET = textwrap.dedent(
    """
    from qir.quantization import FakeQuantize
    from qir.quantization.observer import (
        MovingAveragePerChannelMinMaxObserver,
        MovingAveragePerTensorMinMaxObserver,
    )
    from qir.quantization.qconfig import QConfig

    activation_8bit_fake_quant = FakeQuantize.with_args(
                             observer=MovingAveragePerTensorMinMaxObserver,
                             dtype="qint8",
                             ch_axis=0,
                             averaging_constant=0 # Custom parameter for observer
    )

    weight_8bit_fake_quant = FakeQuantize.with_args(
                             observer=MovingAveragePerChannelMinMaxObserver,
                             dtype="qint8",
                             ch_axis=0,
                             averaging_constant=1 # Custom parameter for observer
    )

    qat_8bit_qconfig = QConfig(
        activation=activation_8bit_fake_quant, weight=weight_8bit_fake_quant
    )
    """
)


def test_seed_custom_qconfig_snippet_runs_and_builds_what_it_says() -> None:
    ns: dict[str, object] = {}
    exec(SEED_SNIPPET, ns)
    qc = ns["qat_8bit_qconfig"]
    assert isinstance(qc, QConfig) and qconfig_kind(qc) == "qat"
    act, weight = build(qc.activation), build(qc.weight)
    assert act.ch_axis is None and averaging(act) == 0.0
    assert weight.ch_axis == 0 and averaging(weight) == 1.0
    w = torch.randn(4, 2, 3, 3)
    weight(w)
    assert weight.scale.shape == (4,)
    act(torch.tensor([-1.0, 1.0]))
    act(torch.tensor([-9.0, 9.0]))  # averaging_constant=0 keeps the first batch
    assert float(act.scale) == pytest.approx(1.0 / 127.5)


def test_seed_module_paths_resolve() -> None:
    assert qir.qconfig.default_calib_8bit_fake_quant_qconfig is default_calib_8bit_fake_quant_qconfig
    assert qir.quantization.get_default_qat_qconfig is get_default_qat_qconfig
    from qir.quantization.qconfig import default_qat_8bit_fake_quant_qconfig as via_module

    assert via_module is default_qat_8bit_fake_quant_qconfig


def test_default_qat_qconfig() -> None:
    qc = get_default_qat_qconfig()
    act, weight = build(qc.activation), build(qc.weight)
    assert type(act) is FakeQuantize and act.dtype.name == "qint8" and act.ch_axis is None
    assert averaging(act) == 0.01
    assert isinstance(weight.observer, MovingAveragePerChannelMinMaxObserver) and weight.ch_axis == 0
    assert qconfig_kind(qc) == "qat"


def test_out_qconfig_has_no_activation_fake_quant() -> None:
    qc = get_default_qat_out_qconfig()
    assert qc.activation is None and qc.weight is not None
    assert default_qat_8bit_weight_32bit_out_fake_quant_qconfig.activation is None
    assert qconfig_kind(qc) == "qat"


def test_calib_qconfig_observes_only() -> None:
    qc = get_default_calib_qconfig()
    act, weight = build(qc.activation), build(qc.weight)
    assert isinstance(act, CalibFakeQuantize) and isinstance(act.observer, PercentileObserver)
    assert act.observer_enabled and not act.fake_quant_enabled and not weight.fake_quant_enabled
    x = torch.randn(10)
    assert torch.equal(act(x), x)
    assert qconfig_kind(qc) == "calibration" and qconfig_kind(default_calib_8bit_fake_quant_qconfig) == "calibration"


def test_16bit_variants() -> None:
    a = build(default_qat_16bit_fake_quant_qconfig.activation)
    w = build(default_qat_16bit_fake_quant_qconfig.weight)
    assert a.dtype.name == "qint16" and w.dtype.name == "qint8"
    c = build(default_calib_16bit_fake_quant_qconfig.activation)
    assert c.dtype.name == "qint16" and qconfig_kind(default_calib_16bit_fake_quant_qconfig) == "calibration"


def test_qkwargs_override_and_are_not_mutated() -> None:
    act_kw = {"averaging_constant": 0.5}
    w_kw = {"averaging_constant": 0.25}
    qc = get_default_qat_qconfig(dtype="qint16", activation_qkwargs=act_kw, weight_qkwargs=w_kw)
    assert act_kw == {"averaging_constant": 0.5} and w_kw == {"averaging_constant": 0.25}
    assert averaging(build(qc.activation)) == 0.5
    assert averaging(build(qc.weight)) == 0.25
    with pytest.raises(TypeError, match="activation_qkwargs must be a dict"):
        get_default_qat_qconfig(activation_qkwargs=[1])  # type: ignore[arg-type]


def test_mixing_kinds_in_one_qconfig_is_rejected() -> None:
    mixed = QConfig(activation=CalibFakeQuantize.with_args(), weight=FakeQuantize.with_args())
    with pytest.raises(ValueError, match="mixes kinds: activation is calibration, weight is qat"):
        qconfig_kind(mixed)


def test_module_instances_are_rejected_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"QConfig.activation got a module instance.*with_args"):
        QConfig(activation=FakeQuantize(), weight=None)
    with pytest.raises(TypeError, match=r"QConfig\.weight must be a factory"):
        QConfig(weight=3)  # type: ignore[arg-type]


def test_qconfig_pickles_and_copies() -> None:
    qc = get_default_qat_qconfig()
    for clone in (pickle.loads(pickle.dumps(qc)), copy.deepcopy(qc)):
        assert isinstance(clone, QConfig)
        assert clone.activation.keywords == qc.activation.keywords  # type: ignore[union-attr]
        assert type(build(clone.weight)) is FakeQuantize


def test_replacing_the_observer_drops_the_default_observers_arguments() -> None:
    from qir.quantization import MinMaxObserver

    calib = get_default_calib_qconfig(calib_qkwargs={"observer": MinMaxObserver})
    act = build(calib.activation)
    assert isinstance(act.observer, MinMaxObserver) and isinstance(act, CalibFakeQuantize)
    qat = get_default_qat_qconfig(weight_qkwargs={"observer": MinMaxObserver})
    w = build(qat.weight)
    assert isinstance(w.observer, MinMaxObserver) and w.ch_axis == 0  # ch_axis is FakeQuantize's own


def test_qconfigs_compare_by_value() -> None:
    assert get_default_qat_qconfig() == get_default_qat_qconfig()
    assert hash(get_default_qat_qconfig()) == hash(get_default_qat_qconfig())
    assert get_default_qat_qconfig() != get_default_qat_qconfig(dtype="qint16")
    assert {get_default_calib_qconfig(), get_default_calib_qconfig()} == {default_calib_8bit_fake_quant_qconfig}
