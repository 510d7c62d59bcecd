"""The QAT sequence layers: a prepared model's ``LSTMCell`` (``qat_lstm_cell``) and
``MultiheadAttention`` (``qat_multihead_attention``, converting to ``qmultihead_attention``;
its fake quants are ``MHA_FAKE_QUANTS``, the masks stay float).

``qat_lstm_cell(input[, h, c])`` -> ``(h', c')`` computes qir's QAT LSTMCell (qir/nn/qat/lstm.py):
the cell with a fake quant at every point its integer form quantizes. Its attributes are the
cell's sizes, whether it has biases and is called with a state, and its fake quants
(``fake_quants``, one :class:`~qir.ir.ops.qat.FakeQuantSpec` per name of :data:`LSTM_FAKE_QUANTS`,
in that order: the module's registration order, so emit keeps the state-dict order). Its state is
``weight_ih``, ``weight_hh`` (+ ``bias_ih``, ``bias_hh``) and every fake quant's buffers. The
``quantize`` pass makes ``qlstm_cell`` of it; legality reads it as the ``nn.LSTMCell`` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from qir.ir.graph import Value
from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import attention as float_ops
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp, fake_quant_roles, is_int
from qir.ir.types import SequenceType, TensorType, Type

__all__ = ["LSTM_FAKE_QUANTS", "MHA_FAKE_QUANTS", "QATLstmCell", "QATMultiheadAttention"]

#: the cell's fake quants, in the QAT module's registration order: the two weight fake quants, then
#: the activation fake quants (qir.nn.qat.lstm.LSTM_FQ_DTYPES; h' is ``activation_post_process``)
LSTM_FAKE_QUANTS = (
    "weight_ih_fake_quant",
    "weight_hh_fake_quant",
    "ih_post_process",
    "hh_post_process",
    "gates_post_process",
    "sigmoid_post_process",
    "tanh_g_post_process",
    "ig_post_process",
    "fc_post_process",
    "cell_post_process",
    "cell_tanh_input",
    "tanh_c_post_process",
    "activation_post_process",
)


def _specs(v: Any) -> tuple[FakeQuantSpec, ...]:
    return tuple(v)


@register_op
@attrs.frozen
class QATLstmCell(QATModuleOp):
    """``(h', c') = LSTMCell(x[, (h, c)])`` with its fake quants; state: weights, biases, fake-quant buffers."""

    name: ClassVar[str] = "qat_lstm_cell"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "h", "c")

    input_size: int
    hidden_size: int
    fake_quants: tuple[FakeQuantSpec, ...] = attrs.field(converter=_specs)
    bias: bool = True
    has_state: bool = False

    def __attrs_post_init__(self) -> None:
        for what in ("input_size", "hidden_size"):
            v = getattr(self, what)
            if not is_int(v) or not 1 <= v <= 1 << 20:
                raise IRError(f"qat_lstm_cell: {what} must be an integer in [1, 2**20], got {v!r}")
        if len(self.fake_quants) != len(LSTM_FAKE_QUANTS) or not all(
            isinstance(f, FakeQuantSpec) for f in self.fake_quants
        ):
            raise IRError(
                f"qat_lstm_cell: fake_quants must be {len(LSTM_FAKE_QUANTS)} FakeQuantSpecs "
                f"({', '.join(LSTM_FAKE_QUANTS)}), got {len(self.fake_quants)}"
            )
        for name, fq in zip(LSTM_FAKE_QUANTS, self.fake_quants, strict=True):
            if not name.startswith("weight") and fq.observer.axis is not None:
                raise IRError(f"qat_lstm_cell: {name} must be per tensor, got axis {fq.observer.axis}")
        for what in ("bias", "has_state"):
            if not isinstance(getattr(self, what), bool):
                raise IRError(f"qat_lstm_cell: {what} must be a boolean, got {getattr(self, what)!r}")

    def fake_quant(self, name: str) -> FakeQuantSpec:
        """The spec of the fake quant ``name`` (one of :data:`LSTM_FAKE_QUANTS`)."""
        return self.fake_quants[LSTM_FAKE_QUANTS.index(name)]

    def num_inputs(self) -> int:
        return 3 if self.has_state else 1

    def param_roles(self) -> tuple[str, ...]:
        params = ("weight_ih", "weight_hh", "bias_ih", "bias_hh") if self.bias else ("weight_ih", "weight_hh")
        fqs = (
            r for name, fq in zip(LSTM_FAKE_QUANTS, self.fake_quants, strict=True) for r in fake_quant_roles(name, fq)
        )
        return (*params, *fqs)

    def own_per_site(self, role: str) -> bool:
        # module swapping ties a call site's weights and weight fake quants to the first call's and
        # gives it its own activation fake quants (qir/quantization/shared_calls.py)
        head, dot, _ = role.partition(".")
        return bool(dot) and not head.startswith("weight")

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QATLstmCell, list[Value]]:
        """Bind ``forward(x, hx=None)`` with ``hx`` a pair ``(h, c)``."""
        if len(args) > 2 or set(kwargs) - {"input", "hx"}:
            raise IRError(f"qat_lstm_cell binds forward(input, hx=None), got {len(args)} args and {sorted(kwargs)}")
        bound = dict(zip(("input", "hx"), args, strict=False)) | kwargs
        x, hx = bound.get("input"), bound.get("hx")
        if not isinstance(x, Value):
            raise IRError("qat_lstm_cell: the input must be a graph value")
        if hx is None:
            return attrs.evolve(self, has_state=False), [x]
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(v, Value) for v in hx)):
            raise IRError("qat_lstm_cell: hx must be a pair of graph values (h, c)")
        return attrs.evolve(self, has_state=True), [x, hx[0], hx[1]]

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments of the module call: ``(input, (h, c))`` or ``(input,)``."""
        return ((inputs[0], (inputs[1], inputs[2])) if self.has_state else (inputs[0],)), {}

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x = operand_types[0]
        if not isinstance(x, TensorType) or x.rank != 2 or x.shape[1] != self.input_size:
            raise IRError(f"qat_lstm_cell takes (batch, {self.input_size}) float tensors, got {x}")
        h = TensorType((x.shape[0], self.hidden_size), x.dtype)
        if self.has_state:
            for i, what in ((1, "h"), (2, "c")):
                t = operand_types[i]
                if not isinstance(t, TensorType) or t.shape != h.shape:
                    raise IRError(f"qat_lstm_cell: {what} must be (batch, {self.hidden_size}), got {t}")
        return SequenceType((h, h))

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        self.infer_type(operand_types)

    def float_op(self) -> Op:
        return float_ops.LstmCell(bias=self.bias, has_state=self.has_state)


#: the attention's fake quants, in the QAT module's registration order: the four projection weights',
#: then the activation fake quants (qir.nn.qat.attention.MHA_FQ_DTYPES), then its softmax's two
MHA_FAKE_QUANTS = (
    "wq_fake_quant",
    "wk_fake_quant",
    "wv_fake_quant",
    "wo_fake_quant",
    "q_post_process",
    "k_post_process",
    "v_post_process",
    "scores_post_process",
    "context_post_process",
    "weights_post_process",
    "activation_post_process",
    "softmax.exp_post_process",
    "softmax.activation_post_process",
)


@register_op
@attrs.frozen
class QATMultiheadAttention(QATModuleOp):
    """A prepared model's ``MultiheadAttention``: ``(query, key, value[, key_padding_mask][, attn_mask])``
    -> ``(output, weights or None)`` with its fake quants (``fake_quants``, one spec per name of
    :data:`MHA_FAKE_QUANTS`). State: ``in_proj_weight`` (+ ``in_proj_bias``), ``out_proj.weight``
    (+ ``out_proj.bias``), every fake quant's buffers. The masks stay float (bool or ``-inf``)."""

    name: ClassVar[str] = "qat_multihead_attention"
    operand_names: ClassVar[tuple[str, ...]] = ("query", "key", "value")

    embed_dim: int
    num_heads: int
    fake_quants: tuple[FakeQuantSpec, ...] = attrs.field(converter=_specs)
    dropout: float = 0.0
    bias: bool = True
    batch_first: bool = False
    need_weights: bool = True
    average_attn_weights: bool = True
    key_padding_mask: bool = False
    attn_mask: bool = False

    def __attrs_post_init__(self) -> None:
        for what in ("embed_dim", "num_heads"):
            v = getattr(self, what)
            if not is_int(v) or not 1 <= v <= 1 << 16:
                raise IRError(f"qat_multihead_attention: {what} must be an integer in [1, 65536], got {v!r}")
        if self.embed_dim % self.num_heads:
            raise IRError(
                f"qat_multihead_attention: embed_dim {self.embed_dim} is not divisible by {self.num_heads} heads"
            )
        if len(self.fake_quants) != len(MHA_FAKE_QUANTS) or not all(
            isinstance(f, FakeQuantSpec) for f in self.fake_quants
        ):
            raise IRError(
                f"qat_multihead_attention: fake_quants must be {len(MHA_FAKE_QUANTS)} FakeQuantSpecs "
                f"({', '.join(MHA_FAKE_QUANTS)}), got {len(self.fake_quants)}"
            )
        if not isinstance(self.dropout, float) or not 0.0 <= self.dropout < 1.0:
            raise IRError(f"qat_multihead_attention: dropout must be a float in [0, 1), got {self.dropout!r}")

    def num_inputs(self) -> int:
        return 3 + int(self.key_padding_mask) + int(self.attn_mask)

    def param_roles(self) -> tuple[str, ...]:
        params = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
        fqs = (
            r for name, fq in zip(MHA_FAKE_QUANTS, self.fake_quants, strict=True) for r in fake_quant_roles(name, fq)
        )
        return (*(params if self.bias else params[::2]), *fqs)

    def fake_quant(self, name: str) -> FakeQuantSpec:
        """The spec of the fake quant ``name`` (one of :data:`MHA_FAKE_QUANTS`)."""
        return self.fake_quants[MHA_FAKE_QUANTS.index(name)]

    def reads_codes_at(self, index: int) -> bool:
        return index < 3  # the masks stay float

    def own_per_site(self, role: str) -> bool:
        # as shared_calls.tie_to ties a swapped call site: a fake quant without "weight" in its name
        # (every one of the attention's, its softmax's too) is the call's own; the parameters are shared
        return any(role.startswith(f"{name}.") and "weight" not in name for name in MHA_FAKE_QUANTS)

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QATMultiheadAttention, list[Value]]:
        """Bind ``forward(query, key, value, key_padding_mask, need_weights, attn_mask, ...)``."""
        return float_ops.bind_quantized_attention(self, args, kwargs)

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments of the module call for the data operands (query, key, value, masks)."""
        return float_ops.quantized_attention_call(self, inputs)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return self.float_op().infer_type(operand_types)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        n = self.num_inputs() + len(self.param_roles())
        if len(operand_types) != n:
            raise IRError(f"op {self.name!r} takes {n} operands, got {len(operand_types)}")
        for i, t in enumerate(operand_types[:3]):
            if not isinstance(t, TensorType) or not t.dtype.is_float:
                raise IRError(f"op {self.name!r}: input {i} must be a float tensor (QAT computes in float), got {t}")
        self.infer_type(operand_types)

    def float_op(self) -> float_ops.MultiheadAttention:
        return float_ops.MultiheadAttention(
            embed_dim=self.embed_dim,
            num_heads=self.num_heads,
            dropout=self.dropout,
            bias=self.bias,
            batch_first=self.batch_first,
            need_weights=self.need_weights,
            average_attn_weights=self.average_attn_weights,
            key_padding_mask=self.key_padding_mask,
            attn_mask=self.attn_mask,
        )
