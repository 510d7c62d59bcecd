"""The plugin's module-level names users import: qir.dtype, the fake_quantize module, defaults."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qir
import qir.quantization as q
from qir.dtype import qinfo, qint8, qint16, qint32
from qir.march import March, march_scope
from qir.quantization import DeQuantStub, QuantStub, compile_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx


def test_qinfo_gives_the_plugins_ranges_and_widths() -> None:
    assert (qinfo(qint8).min, qinfo(qint8).max, qinfo(qint8).bits) == (-128, 127, 8)
    assert (qinfo("qint16").min, qinfo("qint16").max, qinfo("qint16").bits) == (-32768, 32767, 16)
    assert (qinfo(qint32).min, qinfo(qint32).bits) == (-(2**31), 32)
    assert qinfo(torch.qint8).max == 127  # torch's quantized dtypes are accepted too
    assert qir.dtype.qint16 == "qint16"  # reachable as an attribute after `import qir`


def test_unsigned_and_4bit_dtypes_are_refused_by_name() -> None:
    with pytest.raises(ImportError, match=r"qir\.dtype\.quint8 is not supported by qir.*qint8 or qint16"):
        from qir.dtype import quint8  # noqa: F401
    with pytest.raises(ValueError, match="qint4 is not supported"):
        qinfo("qint4")
    # feature tests (the toolkit's `if hasattr(dtype, "quint8")`) see a missing name, not an error
    assert not hasattr(qir.dtype, "quint8") and getattr(qir.dtype, "qint4", None) is None
    with pytest.raises(AttributeError, match=r"qir\.dtype\.quint4 is not supported by qir"):
        qir.dtype.quint4  # noqa: B018


def test_dtype_names_work_where_dtypes_are_asked_for() -> None:
    fq = q.FakeQuantize(dtype=qint16)
    assert (fq.qmin, fq.qmax) == (qinfo(qint16).min, qinfo(qint16).max)
    qc = get_default_qat_qconfig(dtype=qint16)
    assert qc.activation is not None and qc.activation().dtype.name == qint16


def test_fake_quantize_is_the_module_users_reach_into() -> None:
    from qir.quantization import fake_quantize
    from qir.quantization.fake_quantize import FakeQuantize, default_8bit_fake_quant

    assert FakeQuantize is q.FakeQuantize
    assert isinstance(fake_quantize.default_16bit_fake_quant(), FakeQuantize)
    assert default_8bit_fake_quant().dtype.name == "qint8"
    w = fake_quantize.default_weight_8bit_fake_quant()
    assert w.ch_axis == 0 and w.dtype.name == "qint8"
    # calling it still fake-quantizes, as before it was a module (half up, saturating)
    out = q.fake_quantize(torch.tensor([0.25, 0.26, 50.0]), torch.tensor([0.1]))
    assert torch.allclose(out, torch.tensor([0.3, 0.3, 12.7]))


class _Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.up = qir.nn.Interpolate(scale_factor=2)  # the plugin's default: bilinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.up(self.conv(self.quant(x))))


def test_interpolate_defaults_to_bilinear_like_the_plugin() -> None:
    m = qir.nn.Interpolate(scale_factor=2)
    assert (m.mode, m.align_corners) == ("bilinear", None)
    x = torch.randn(1, 2, 5, 7)
    assert torch.equal(m(x), F.interpolate(x, scale_factor=2, mode="bilinear"))
    assert not torch.equal(m(x), F.interpolate(x, scale_factor=2, mode="nearest"))


def test_default_interpolate_prepares_converts_and_compiles_bilinear() -> None:
    torch.manual_seed(0)
    with march_scope(March.BAYES):
        qat = prepare_qat_fx(_Up(), {"": get_default_qat_qconfig()})
        for _ in range(3):
            qat(torch.rand(1, 3, 6, 6))
        qat.eval()
        assert qat.up.activation_post_process is not None  # bilinear requantizes: its own output scale
        x = torch.rand(1, 3, 6, 6)
        converted = convert_fx(qat)
        assert converted.up.mode == "bilinear"
        want = converted(x)
        assert (want - qat(x)).abs().max() <= 2 * float(qat.up.activation_post_process.scale)
        assert torch.equal(compile_model(converted, [x])(x), want)


def test_qtensor_carries_codes_and_their_scale() -> None:
    import copy
    import io

    from qir.qtensor import QTensor

    q = QTensor(torch.tensor([-3, 5, 127], dtype=torch.int8), 0.5, qint8)
    assert isinstance(q, torch.Tensor) and isinstance(q, QTensor) and q.is_quantized
    assert torch.equal(q.dequantize(), torch.tensor([-1.5, 2.5, 63.5]))
    assert torch.equal(q.int_repr(), torch.tensor([-3, 5, 127], dtype=torch.int8))
    assert float(q.q_scale()) == 0.5 and int(q.q_zero_point()) == 0 and q.q_per_channel_axis() == -1
    assert q.dtype == qint8 and q.qtype == q.qdtype == "qint8"  # the quantized dtype, as the plugin's
    assert q.storage_dtype == torch.int8 and q.as_subclass(torch.Tensor).dtype == torch.int8
    assert QTensor(torch.zeros(2), 0.5, "qint16").storage_dtype == torch.float32  # fake-quantized values
    plain = q.as_subclass(torch.Tensor)
    assert type(plain) is torch.Tensor and type(q + 1) is torch.Tensor  # ops drop the scale, never carry it
    again = copy.deepcopy(q)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (again, loaded):
        assert isinstance(other, QTensor) and torch.equal(other.dequantize(), q.dequantize())


def test_qtensor_of_float_values_rounds_half_up_per_channel() -> None:
    from qir.qtensor import QTensor

    f = QTensor(torch.tensor([[0.25, -0.25], [3.0, 200.0]]), torch.tensor([0.5, 1.0]), qint8, per_channel_axis=0)
    assert not f.is_quantized
    assert f.int_repr().tolist() == [[1, 0], [3, 127]]  # ties round half up (0.5 -> 1, -0.5 -> 0); 200 saturates
    assert torch.equal(f.dequantize(), f.as_subclass(torch.Tensor))
    with pytest.raises(ValueError, match="per_channel_axis=0 with 3 scales"):
        QTensor(torch.zeros(2, 2), torch.ones(3), qint8, per_channel_axis=0)
    with pytest.raises(ValueError, match="2 scales for a per-tensor QTensor"):
        QTensor(torch.zeros(2), torch.ones(2))


def test_user_post_processing_that_checks_for_qtensor_runs_on_qir_outputs() -> None:
    from qir.qtensor import QTensor

    def decode(score: torch.Tensor) -> torch.Tensor:  # as heads in the plugin's toolkit write it
        if isinstance(score, QTensor):
            score = score.dequantize()
        return score.sigmoid() > 0.5

    codes = QTensor(torch.tensor([-4, 0, 6], dtype=torch.int8), 0.25)
    assert decode(codes).tolist() == [False, False, True]
    assert decode(torch.tensor([-1.0, 0.0, 1.5])).tolist() == [False, False, True]


def test_torch_qconfig_of_qir_factories_converts_and_torch_factories_are_explained() -> None:
    from torch.ao.quantization import FakeQuantize as TorchFakeQuantize
    from torch.ao.quantization import QConfig as TorchQConfig

    from qir.quantization import as_qir_qconfig, qconfig_kind

    tq = TorchQConfig(activation=q.FakeQuantize.with_args(dtype=qint16), weight=None)
    qc = as_qir_qconfig(tq)
    assert isinstance(qc, q.QConfig) and qc.activation is tq.activation and qc.weight is None
    assert qconfig_kind(qc) == "qat"
    stub = QuantStub(qconfig=tq)
    assert isinstance(stub.qconfig, q.QConfig) and stub.make_fake_quant().dtype.name == "qint16"
    bad = TorchQConfig(activation=TorchFakeQuantize.with_args(), weight=None)
    with pytest.raises(TypeError, match=r"QuantStub qconfig: activation .* torch\.ao\.quantization factory"):
        QuantStub(qconfig=bad)
    with pytest.raises(TypeError, match="must be a qir QConfig"):
        as_qir_qconfig("qint8", "qconfig_dict['']")


def test_plugin_fake_quant_arguments_accepted_when_they_mean_qirs_range() -> None:
    from qir.quantization import MovingAverageMinMaxObserver

    fq = q.FakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver,
        quant_min=qinfo("qint16").min,
        quant_max=qinfo("qint16").max,
        dtype=qint16,
        saturate=True,
    )()
    assert (fq.qmin, fq.qmax) == (-32768, 32767)
    with pytest.raises(ValueError, match=r"quant_min=-127\) with dtype=qint8: qir quantizes to the full range"):
        q.FakeQuantize.with_args(quant_min=-127, dtype=qint8)
    with pytest.raises(ValueError, match="saturate=False"):
        q.FakeQuantize(saturate=False)


def test_calibration_out_qconfig_is_calibration_with_no_output_fake_quant() -> None:
    from qir.qconfig import default_calib_8bit_weight_32bit_out_fake_quant_qconfig as calib_out

    assert calib_out.activation is None and q.qconfig_kind(calib_out) == "calibration"
    w = calib_out.weight()
    assert isinstance(w, q.CalibFakeQuantize) and w.ch_axis == 0


def test_fuse_conv_shared_modules_names_a_missing_module() -> None:
    seq = nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))
    with pytest.raises(ValueError, match=r"has no module '5'; its modules: 0, 1"):
        q.fuse_conv_shared_modules(seq, [["0", "5"]])
    fused = q.fuse_conv_shared_modules(seq, ["0", "1"])  # one group without the outer list
    assert isinstance(fused[0], nn.Identity) and isinstance(fused[1], nn.Conv2d)
    assert isinstance(seq[1], nn.BatchNorm2d)  # not inplace: the input is unchanged


def test_a_qtensor_of_codes_enters_a_model_at_its_real_values() -> None:
    from qir.qtensor import QTensor

    torch.manual_seed(0)
    with march_scope(March.BAYES):
        model = nn.Sequential(QuantStub(scale=1 / 64), nn.Conv2d(2, 2, 1), DeQuantStub())
        qat = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
        for _ in range(2):
            qat(torch.rand(1, 2, 3, 3))
        q.set_fake_quantize(qat, "validation")
        converted = convert_fx(qat)
    x = torch.rand(1, 2, 3, 3)
    codes = torch.floor(x * 64 + 0.5).to(torch.int8)
    as_qtensor = QTensor(codes, 1 / 64, qint8)
    # the plugin's multi-subnet input: codes at the stub's own scale pass through the quantized stub
    assert torch.equal(converted(as_qtensor), converted(codes.float() / 64))
    # the QAT stub fake-quantizes the QTensor's real values, not its codes
    assert torch.equal(qat(as_qtensor), qat(codes.float() / 64))
    with pytest.raises(ValueError, match=r"QTensor of qint8 codes at scale \[0\.5\] but quantizes to qint8"):
        converted(QTensor(codes, 0.5, qint8))
