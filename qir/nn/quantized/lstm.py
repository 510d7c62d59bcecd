"""Quantized LSTMCell: integer linears, the add rule, sigmoid / tanh tables and exact products."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import check_out_dtype
from passes.legality_facts import register_module_view
from qir.ir.types import DType
from qir.nn.qat.lstm import LSTMCell as QATLSTMCell
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name
from qir.nn.quantized._composed import fq_scale, integer_linear, linear_from_spec, product_params
from qir.nn.quantized.conv import QuantizedConvBase
from qir.quantization.fake_quantize import FakeQuantize

__all__ = ["LSTMCell"]


def _weights(
    qat: QATLSTMCell, which: str, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, FakeQuantize]:
    return getattr(qat, f"weight_{which}"), bias, getattr(qat, f"weight_{which}_fake_quant")


class LSTMCell(QuantizedModule):
    """Integer ``(h', c') = LSTMCell(x, (h, c))`` (docs/semantics.md "LSTMCell")::

        gates = add_int(ih(x), hh(h))                 # or ih(x) with bias b_ih + b_hh, without a state
        sig   = sigmoid_table[gates]; g = tanh_g_table[chunk(gates, 4)[2]]
        c'    = add_int(rq(f * c), rq(i * g))          # or rq(i * g) without a state; qint16
        h'    = rq(o * tanh_c_table[rq(c')])          # rq(c'): c' requantized to the qint8 table input

    Every ``rq`` is one requantization of an exact product (``conv_requant_params``).
    ``has_state`` is fixed at conversion: a module converted for calls with ``(h, c)`` needs them.
    """

    derived: ClassVar[tuple[str, ...]] = ("rq", "gates_add", "cell_add")

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.LSTMCell
    num_inputs: ClassVar[int] = -1
    input_size: int
    hidden_size: int
    has_bias: bool
    has_state: bool
    march: str
    gates_add: numerics.AddParams | None
    cell_add: numerics.AddParams | None
    #: (multiplier, shift) of each requantized product / rescale
    rq: dict[str, tuple[int, int]]
    #: output dtype of each requantization step
    dtypes: dict[str, DType]
    sigmoid_table: torch.Tensor
    tanh_g_table: torch.Tensor
    tanh_c_table: torch.Tensor
    cell_scale: torch.Tensor
    cell_dtype: DType
    ih: QuantizedConvBase
    hh: QuantizedConvBase | None

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> LSTMCell:
        check_qat(cls, qat, QATLSTMCell)
        assert isinstance(qat, QATLSTMCell)
        name = cls.__name__
        if len(input_scales) not in (1, 3):
            raise ValueError(f"{name}.from_qat: give the scales of x, or of x, h and c; got {len(input_scales)}")
        mname = march_name(march)
        new = cls()
        h_fq, c_fq = qat.output_fake_quants()
        new._set_scales(input_scales, h_fq.scale.detach(), h_fq.dtype, len(input_scales))
        new.register_buffer("cell_scale", c_fq.scale.detach().to(torch.float32).reshape(1).clone())
        new.cell_dtype = DType(c_fq.dtype)
        for fq_name in qat.requantized_fake_quants:
            check_out_dtype(mname, getattr(qat, fq_name).dtype, f"{name} {fq_name}")
        for fq_name in ("gates_post_process", "cell_tanh_input", "ih_post_process", "hh_post_process"):
            if DType(getattr(qat, fq_name).dtype) is not DType.qint8:
                raise ValueError(f"{name}: {fq_name} must be qint8 (a 256-entry table reads it)")
        new.input_size, new.hidden_size, new.has_bias = qat.input_size, qat.hidden_size, bool(qat.bias)
        new.has_state = len(input_scales) == 3
        new.march = mname
        s_x = new.per_tensor_input(0)
        gates = qat.gates_post_process
        s_g = fq_scale(gates)
        b_ih, b_hh = qat.bias_ih, qat.bias_hh
        new.rq, new.dtypes = {}, {}
        if new.has_state:
            new.ih = integer_linear(*_weights(qat, "ih", b_ih), qat.ih_post_process, qat.qconfig, s_x, mname)
            new.hh = integer_linear(
                *_weights(qat, "hh", b_hh), qat.hh_post_process, qat.qconfig, new.per_tensor_input(1), mname
            )
            new.gates_add = numerics.add_params(
                fq_scale(qat.ih_post_process), fq_scale(qat.hh_post_process), s_g, mname, DType.qint8
            )
        else:
            bias = None if b_ih is None or b_hh is None else b_ih.detach() + b_hh.detach()
            new.ih = integer_linear(*_weights(qat, "ih", bias), gates, qat.qconfig, s_x, mname)
            new.hh = None
            new.gates_add = None
        sig, tg, tc = qat.sigmoid_post_process, qat.tanh_g_post_process, qat.tanh_c_post_process
        c8 = qat.cell_tanh_input
        s_sig, s_tg, s_c, s_c8, s_tc = fq_scale(sig), fq_scale(tg), fq_scale(c_fq), fq_scale(c8), fq_scale(tc)
        with torch.no_grad():
            new.register_buffer("sigmoid_table", numerics.lut_int8(torch.sigmoid, s_g, s_sig, sig.dtype))
            new.register_buffer("tanh_g_table", numerics.lut_int8(torch.tanh, s_g, s_tg, tg.dtype))
            new.register_buffer("tanh_c_table", numerics.lut_int8(torch.tanh, s_c8, s_tc, tc.dtype))
        c_dt = new.cell_dtype
        if new.has_state:
            s_fc, s_ig = fq_scale(qat.fc_post_process), fq_scale(qat.ig_post_process)
            if DType(qat.fc_post_process.dtype) is not c_dt or DType(qat.ig_post_process.dtype) is not c_dt:
                raise ValueError(
                    f"{name}: fc_post_process, ig_post_process and cell_post_process need one dtype "
                    "(the add rule takes operands of the output's dtype)"
                )
            new.rq["fc"] = product_params(s_sig, new.per_tensor_input(2), s_fc, mname, c_dt)
            new.rq["ig"] = product_params(s_sig, s_tg, s_ig, mname, c_dt)
            new.dtypes["fc"] = new.dtypes["ig"] = c_dt
            new.cell_add = numerics.add_params(s_fc, s_ig, s_c, mname, c_dt)
        else:
            new.rq["ig"] = product_params(s_sig, s_tg, s_c, mname, c_dt)
            new.dtypes["ig"] = c_dt
            new.cell_add = None
        m, s = numerics.requant_params(s_c, s_c8, mname, DType.qint8)
        new.rq["c8"], new.dtypes["c8"] = (int(m), int(s)), DType.qint8
        assert new.dtype is not None
        new.rq["h"] = product_params(s_sig, s_tc, float(new.scale[0]), mname, new.dtype)
        new.dtypes["h"] = new.dtype
        return new

    def _rq(self, key: str, acc: torch.Tensor) -> torch.Tensor:
        m, s = self.rq[key]
        return numerics.requantize(acc, m, s, self.dtypes[key])

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_floating_point() or x.dim() != 2:
            raise TypeError(
                f"LSTMCell takes 2-dimensional integer codes (batch, features); got {x.dtype} of rank {x.dim()}"
            )
        if (hx is not None) != self.has_state:
            raise ValueError(
                "LSTMCell was converted for calls "
                + ("with (h, c)" if self.has_state else "without a state")
                + " and is called "
                + ("without one" if hx is None else "with (h, c)")
                + "; use one module instance per call form"
            )
        return self.state_from_gates(self.gates(x, hx), None if hx is None else hx[1])

    def gates(self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The qint8 gate codes ``(i, f, g, o)`` at ``gates_post_process``'s scale."""
        if hx is None:
            return self.ih(x)
        assert self.hh is not None and self.gates_add is not None
        return numerics.add_int(self.ih(x), self.hh(hx[0]), self.gates_add, DType.qint8)

    def state_from_gates(self, gates: torch.Tensor, c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h', c')`` from the gate codes and the cell state codes (``None``: zeros)."""
        sig = numerics.lut_apply(self.sigmoid_table, gates).to(torch.int64)
        i, f, _, o = sig.chunk(4, dim=1)
        g = numerics.lut_apply(self.tanh_g_table, gates.chunk(4, dim=1)[2]).to(torch.int64)
        ig = self._rq("ig", i * g)
        if c is None:
            c_new = ig
        else:
            assert self.cell_add is not None
            fc = self._rq("fc", f * c.to(torch.int64))
            c_new = numerics.add_int(fc, ig, self.cell_add, self.cell_dtype)
        tc = numerics.lut_apply(self.tanh_c_table, self._rq("c8", c_new.to(torch.int64))).to(torch.int64)
        return self._rq("h", o * tc), c_new

    def extra_repr(self) -> str:
        return (
            f"{self.input_size}, {self.hidden_size}, bias={self.has_bias}, has_state={self.has_state}, "
            f"cell=qint16 scale {float(self.cell_scale[0]):.6g}, {super().extra_repr()}"
        )


def _legality_view(m: nn.Module) -> nn.Module | None:
    """The float LSTMCell (on the meta device) the operator tables describe a quantized one as."""
    if not isinstance(m, LSTMCell):
        return None
    return nn.LSTMCell(m.input_size, m.hidden_size, bias=m.has_bias, device="meta")


register_module_view(_legality_view)


# ----------------------------------------------------------------------------- the IR's qlstm_cell op


def _add_params(p: Any) -> numerics.AddParams | None:
    return None if p is None else numerics.AddParams(*p)


def _from_qlstm_cell(op: Any, tensors: dict[str, torch.Tensor]) -> LSTMCell:
    m = LSTMCell()
    m._set_scales(op.in_scales, torch.tensor(op.out.scale), op.out.dtype, len(op.in_scales))
    m.register_buffer("cell_scale", torch.tensor(op.cell.scale, dtype=torch.float32))
    m.cell_dtype = op.cell.dtype
    m.input_size, m.hidden_size, m.has_bias = int(op.input_size), int(op.hidden_size), bool(op.has_bias)
    m.has_state, m.march = bool(op.has_state), str(op.march)
    m.ih = linear_from_spec(op.march, op.in_scales[0], op.ih_out, tensors, "ih")
    m.hh = linear_from_spec(op.march, op.in_scales[1], op.hh_out, tensors, "hh") if op.has_state else None
    m.gates_add, m.cell_add = _add_params(op.gates_add), _add_params(op.cell_add)
    m.rq = {k: (mult, shift) for k, (mult, shift, _) in op.requant_dict().items()}
    m.dtypes = {k: d for k, (_, _, d) in op.requant_dict().items()}
    for role in ("sigmoid_table", "tanh_g_table", "tanh_c_table"):
        m.register_buffer(role, tensors[role])
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_sequence import QLstmCell

    register_integer_module(QLstmCell, LSTMCell, _from_qlstm_cell)


_register_ir()
