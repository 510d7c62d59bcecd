"""Writes the version-1 (uniform 513-knot) table16 files this directory holds. Run with the qir of
commit c089389 (before the table format had a version) to reproduce them:

    git worktree add /tmp/qir-v1 c089389 && PYTHONPATH=/tmp/qir-v1 python tests/data/table16_v1/make.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qir.frontend import trace
from qir.ir import print_graph
from qir.march import march_scope
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

HERE = Path(__file__).parent


class TanhExp(nn.Module):
    """qint16 codes into Tanh (a qint16 output) and FloatFunctional.exp: two segmented tables."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.act = nn.Tanh()
        self.ff = FloatFunctional()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.ff.exp(self.act(self.quant(x))))


def main() -> None:
    q16 = get_default_qat_qconfig(dtype="qint16")
    x = torch.linspace(-8.0, 8.0, 4096).reshape(4, 1024)
    with march_scope("bayes"):
        m = prepare_qat_fx(TanhExp().eval(), {"": q16})
        m(x)
        set_fake_quantize(m, "validation")
        conv = convert_fx(m)
    g = trace(conv, x)
    (HERE / "model.qir").write_text(print_graph(g) + "\n")
    torch.save({k: v.clone() for k, v in g.constants.items()}, HERE / "constants.pt")
    compile_model(conv, x, hbm=HERE / "model.hbm", march="bayes")
    torch.save({"x": x, "y": conv(x)}, HERE / "io.pt")


if __name__ == "__main__":
    main()
