"""QAT LSTMCell: ``nn.LSTMCell`` with a fake quant at every point its integer form quantizes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qir.nn.qat._base import QATModule, make_weight_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig

__all__ = ["LSTMCell", "LSTM_FQ_DTYPES"]

#: Fake quant name -> dtype (``None``: the qconfig's activation dtype). The gates and the tanh
#: input of the cell state are qint8 because the sigmoid / tanh tables take 256 codes; the cell
#: state and everything that feeds it are qint16, because an LSTM's cell state accumulates over
#: time steps and qint8 would lose its small updates.
LSTM_FQ_DTYPES: dict[str, str | None] = {
    "ih_post_process": "qint8",
    "hh_post_process": "qint8",
    "gates_post_process": "qint8",
    "sigmoid_post_process": "qint16",
    "tanh_g_post_process": "qint16",
    "ig_post_process": "qint16",
    "fc_post_process": "qint16",
    "cell_post_process": "qint16",
    "cell_tanh_input": "qint8",
    "tanh_c_post_process": "qint16",
    "activation_post_process": None,
}


class LSTMCell(QATModule, nn.LSTMCell):
    """``(h', c') = LSTMCell(x, (h, c))`` composed of the pieces the integer form computes.

    ``forward(x, hx=None)``; with ``hx = (h, c)``::

        gates = fq_gates(fq_ih(linear(x, fq_w(W_ih), b_ih)) + fq_hh(linear(h, fq_w(W_hh), b_hh)))
        i, f, g, o = chunk(gates, 4)
        sig   = fq_sig(sigmoid(gates))                      # i, f, o read their chunks of it
        g     = fq_tanh_g(tanh(g))
        c'    = fq_c(fq_fc(f * c) + fq_ig(i * g))
        h'    = fq_h(o * fq_tanh_c(tanh(fq_c8(c'))))

    Without ``hx`` (zeros): ``gates = fq_gates(linear(x, fq_w(W_ih), b_ih + b_hh))`` and
    ``c' = fq_c(i * g)``. Parameters, constructor and state-dict keys of the weights are
    ``nn.LSTMCell``'s, so float checkpoints load. The outputs' scales are ``cell_post_process``
    (qint16) and ``activation_post_process`` (the qconfig's activation dtype) for ``h'``.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.LSTMCell
    #: the fake quants the integer form requantizes into (the march must produce their dtypes: prepare
    #: and from_qat check them); the others read 256-entry tables and stay qint8
    requantized_fake_quants: ClassVar[tuple[str, ...]] = (
        "activation_post_process",
        "cell_post_process",
        "sigmoid_post_process",
        "tanh_g_post_process",
        "tanh_c_post_process",
        "fc_post_process",
        "ig_post_process",
    )
    #: x, or x, h and c: as many grid inputs as the call site has tensors (qir.quantization.integer_grid)
    grid_inputs: ClassVar[int] = -1
    #: ``(applies, forward)`` of the integer-grid forward, set by qir.nn.quantized.lstm_grid (it builds
    #: the converted cell, which this layer cannot import). ``applies`` is checked before the float
    #: forward; ``forward`` gets its result and whether the grid applies, and counts the call as on the
    #: grid or fallen back (qir.quantization.integer_grid.grid_step)
    grid_hooks: ClassVar[tuple[Callable[..., bool], Callable[..., Any]] | None] = None
    weight_ih_fake_quant: FakeQuantize
    weight_hh_fake_quant: FakeQuantize
    activation_post_process: FakeQuantize
    cell_post_process: FakeQuantize
    ih_post_process: FakeQuantize
    hh_post_process: FakeQuantize
    gates_post_process: FakeQuantize
    sigmoid_post_process: FakeQuantize
    tanh_g_post_process: FakeQuantize
    ig_post_process: FakeQuantize
    fc_post_process: FakeQuantize
    cell_tanh_input: FakeQuantize
    tanh_c_post_process: FakeQuantize

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool = True, *, qconfig: QConfig, device: Any = None
    ) -> None:
        super().__init__(input_size, hidden_size, bias, device=device)
        name = type(self).__name__
        self.qconfig = qconfig
        self.weight_ih_fake_quant = make_weight_fq(qconfig, name, 0)
        self.weight_hh_fake_quant = make_weight_fq(qconfig, name, 0)
        if qconfig.activation is None:
            raise ValueError(f"{name} needs qconfig.activation (its states and gates are quantized); got None")
        for fq_name, dtype in LSTM_FQ_DTYPES.items():
            fq = qconfig.activation() if dtype is None else qconfig.activation(dtype=dtype)
            if not isinstance(fq, FakeQuantize):
                raise TypeError(f"{name}: qconfig.activation must build a qir FakeQuantize, got {type(fq).__name__}")
            setattr(self, fq_name, fq)

    def output_fake_quants(self) -> tuple[FakeQuantize, FakeQuantize]:
        """The fake quants of the two outputs ``(h', c')``."""
        return self.activation_post_process, self.cell_post_process

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:
            raise ValueError(f"{type(self).__name__}: input must be 2-dimensional (batch, features), got {x.dim()}")
        hooks = type(self).grid_hooks
        on_grid = hooks is not None and hooks[0](self, x, hx)
        floats = self.state_from_gates(self.gates(x, hx), None if hx is None else hx[1])
        if hooks is None:
            return floats
        out: tuple[torch.Tensor, torch.Tensor] = hooks[1](self, x, hx, floats, on_grid)
        return out

    def gates(self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The fake-quantized gates ``(i, f, g, o)`` (``gates_post_process``)."""
        fq = self._fq
        w_ih = self.weight_ih_fake_quant(self.weight_ih)
        b_ih, b_hh = self.bias_ih, self.bias_hh
        if hx is None:
            bias = None if b_ih is None or b_hh is None else b_ih + b_hh
            return fq("gates_post_process", F.linear(x, w_ih, bias))
        a = fq("ih_post_process", F.linear(x, w_ih, b_ih))
        b = fq("hh_post_process", F.linear(hx[0], self.weight_hh_fake_quant(self.weight_hh), b_hh))
        return fq("gates_post_process", a + b)

    def state_from_gates(self, gates: torch.Tensor, c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h', c')`` from the gates and the cell state (``None``: zeros)."""
        fq = self._fq
        sig = fq("sigmoid_post_process", torch.sigmoid(gates))
        i, f, _, o = sig.chunk(4, dim=1)
        g = fq("tanh_g_post_process", torch.tanh(gates.chunk(4, dim=1)[2]))
        if c is None:
            c_new = fq("cell_post_process", i * g)
        else:
            c_new = fq("cell_post_process", fq("fc_post_process", f * c) + fq("ig_post_process", i * g))
        tc = fq("tanh_c_post_process", torch.tanh(fq("cell_tanh_input", c_new)))
        return fq("activation_post_process", o * tc), c_new

    def _fq(self, name: str, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = getattr(self, name)(x)
        return out

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> LSTMCell:
        if type(mod) is not nn.LSTMCell:
            raise TypeError(f"LSTMCell.from_float takes nn.LSTMCell, got {type(mod).__name__}")
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        assert isinstance(mod, nn.LSTMCell)
        new = cls(mod.input_size, mod.hidden_size, mod.bias, qconfig=qc)
        new.to(device=mod.weight_ih.device)
        with torch.no_grad():
            for pname, p in mod.named_parameters():
                getattr(new, pname).copy_(p)
                getattr(new, pname).requires_grad_(p.requires_grad)
        new.train(mod.training)
        return new
