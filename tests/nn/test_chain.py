"""A whole small model taken float -> QAT -> quantized through the two maps, as the eager flow does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from nn_helpers import QC8
from torch import nn

from backends.common import numerics
from qir.nn import QAT_MODULE_MAP, QUANTIZED_MODULE_MAP
from qir.nn.intrinsic import ConvAddReLU2d, ConvReLU2d
from qir.quantization import DeQuantStub, QuantStub, disable_observer, get_default_qat_out_qconfig

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


def _float_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    out = nn.Conv2d(6, 4, 1)
    out.qconfig = get_default_qat_out_qconfig()  # type: ignore[assignment]
    return [
        QuantStub(scale=1 / 128),
        ConvReLU2d(nn.Conv2d(1, 6, 3)),
        nn.MaxPool2d(2),
        ConvReLU2d(nn.Conv2d(6, 6, 3, padding=1)),
        nn.AvgPool2d(3),
        out,
        DeQuantStub(),
    ]


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_seed_eager_net_end_to_end(march: str) -> None:
    layers = _float_layers()
    qat_layers = [
        QAT_MODULE_MAP[type(m)].from_float(m, getattr(m, "qconfig", None) or QC8)  # type: ignore[attr-defined]
        for m in layers
    ]
    qat_model = nn.Sequential(*qat_layers).eval()
    x = torch.rand(2, 1, 14, 14) * 2 - 1
    qat_model(x)
    disable_observer(qat_model)
    qat_out = qat_model(x)

    converted: list[nn.Module] = []
    scale: Any = None
    for m in qat_layers:
        qcls: Any = QUANTIZED_MODULE_MAP[type(m)]
        q = qcls.from_qat(m, [] if scale is None else [scale], march)
        converted.append(q)
        scale = q.scale
    q_model = nn.Sequential(*converted)
    q_out = q_model(x)
    assert q_out.dtype == torch.float32 and q_out.shape == qat_out.shape
    # the last conv is high precision: compare in units of its input scale times weight scale
    assert torch.allclose(q_out, qat_out, atol=0.05 * float(qat_out.abs().max()))
    traced = torch.jit.trace(q_model, (x,))
    assert torch.equal(traced(x), q_out)


def test_fused_add_chain_matches_qat_codes() -> None:
    torch.manual_seed(1)
    stub_x, stub_y = QuantStub(), QuantStub()
    fused = ConvAddReLU2d(nn.Conv2d(3, 3, 3, padding=1))
    qx, qy, qf = (QAT_MODULE_MAP[type(m)].from_float(m, QC8) for m in (stub_x, stub_y, fused))  # type: ignore[attr-defined]
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    qf(qx(x), qy(y))
    for m in (qx, qy, qf):
        disable_observer(m)
    ref = qf(qx(x), qy(y))
    cx = QUANTIZED_MODULE_MAP[type(qx)].from_qat(qx, [], "bayes")  # type: ignore[attr-defined]
    cy = QUANTIZED_MODULE_MAP[type(qy)].from_qat(qy, [], "bayes")  # type: ignore[attr-defined]
    cf = QUANTIZED_MODULE_MAP[type(qf)].from_qat(qf, [cx.scale, cy.scale], "bayes")  # type: ignore[attr-defined]
    out = cf(cx(x), cy(y))
    want = numerics.quantize(ref, cf.scale, "qint8")
    assert int((out.to(torch.int64) - want.to(torch.int64)).abs().max()) <= 1


def test_qat_and_quantized_modules_pickle() -> None:
    import io

    import qir.nn as qnn

    layers = [qnn.Exp(), nn.Sigmoid(), ConvAddReLU2d(nn.Conv2d(2, 2, 1))]
    for fl in layers:
        m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8)  # type: ignore[attr-defined]
        args = [torch.randn(1, 2, 3, 3)] * (2 if isinstance(fl, ConvAddReLU2d) else 1)
        m(*args)
        q = QUANTIZED_MODULE_MAP[type(m)].from_qat(m, [torch.tensor([0.05])] * len(args), "bayes")  # type: ignore[attr-defined]
        for obj in (m, q):
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            back = torch.load(buf, weights_only=False)
            assert type(back) is type(obj)
        codes = [numerics.quantize(a, 0.05, "qint8") for a in args]
        assert torch.equal(back(*codes), q(*codes))
