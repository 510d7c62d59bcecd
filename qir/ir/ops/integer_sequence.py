"""Integer sequence layers: the LSTM cell and multi-head attention, each one op with tuple results.

Both are composed of integer linears (each the ``qconv`` rule, its output spec an attribute,
its integer state operands ``<proj>.weight``, ``<proj>.bias``, ``<proj>.multiplier``,
``<proj>.shift``, ``<proj>.relu6_bound``: the state-dict names of the module's children),
requantized exact products (``requant``: ``(step, multiplier, shift, dtype)`` per step) and
256-entry tables:

* ``qlstm_cell``: ``(input[, h, c])`` -> ``(h', c')`` (docs/semantics.md "LSTMCell"): the
  ``ih`` / ``hh`` linears, the gates' integer add (``gates_add``), the sigmoid / tanh tables,
  the cell's add (``cell_add``), the cell state at ``cell`` (qint16 on Bayes);
* ``qmultihead_attention``: ``(query, key, value[, key_padding_mask][, attn_mask])`` ->
  ``(output, weights or None)`` (docs/semantics.md "MultiheadAttention"): the ``q_proj`` /
  ``k_proj`` / ``v_proj`` / ``out_proj`` linears, the scores' and context's requantizations,
  the integer softmax (``softmax``: its spec, ``softmax_multiplier`` / ``softmax_shift`` and
  the ``softmax.table`` operand), the returned weights' requantization.

A traced call reads its results through ``getitem`` nodes, as any tuple-valued op; the result
type carries each output's QuantSpec. Evaluating one rebuilds the integer module, so the
interpreter and emit equal the converted model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir.graph import Value
from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import attention as float_ops
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import check_int, check_march, check_scales, code_dtype, per_tensor_scale
from qir.ir.ops.integer_values import check_exp_table, check_linear_state
from qir.ir.types import DType, QuantSpec, SequenceType, TensorType, Type

__all__ = ["QLstmCell", "QMultiheadAttention", "linear_roles"]

_LINEAR_STATE = ("weight", "bias", "multiplier", "shift", "relu6_bound")


def linear_roles(proj: str) -> tuple[str, ...]:
    """The state operands of the integer linear ``proj`` (its buffers' state-dict names)."""
    return tuple(f"{proj}.{r}" for r in _LINEAR_STATE)


def _requant(v: Any) -> tuple[tuple[str, int, int, DType], ...]:
    """``requant`` as printable data: ``(step, multiplier, shift, dtype)``, sorted by step."""
    items = v.items() if isinstance(v, dict) else [(x[0], tuple(x[1:])) for x in v]
    out = []
    for key, rest in items:
        m, s, d = rest
        out.append((str(key), int(m), int(s), d if isinstance(d, DType) else DType[str(d)]))
    return tuple(sorted(out))


def _add(v: Any) -> tuple[bool, int, int, int, int] | None:
    """The integer add's ``(swap, shift, qscale, multiplier, out_shift)`` (numerics.AddParams)."""
    if v is None:
        return None
    swap, shift, qscale, mult, out_shift = v
    return bool(swap), int(shift), int(qscale), int(mult), int(out_shift)


def _specs(v: Any) -> tuple[QuantSpec, ...]:
    return tuple(v)


def _per_tensor(op: str, what: str, spec: QuantSpec | None, dtypes: Sequence[DType]) -> None:
    if spec is None:
        return
    if spec.axis is not None or len(spec.scale) != 1 or spec.dtype not in dtypes:
        names = " / ".join(d.name for d in dtypes)
        raise IRError(f"op {op!r}: {what} must be a per-tensor {names} spec, got {spec}")
    check_scales(op, what, spec.scale)


def _check_requant(op: str, requant: Sequence[tuple[str, int, int, DType]], keys: set[str]) -> None:
    got = {k for k, *_ in requant}
    if got != keys:
        raise IRError(f"op {op!r}: requant must hold exactly the steps {sorted(keys)}, got {sorted(got)}")
    for key, m, s, d in requant:
        check_int(op, f"requant[{key!r}] multiplier", m, -(2**31) + 1, 2**31 - 1)
        check_int(op, f"requant[{key!r}] shift", s, 0, 62)
        if d not in (DType.qint8, DType.qint16):
            raise IRError(f"op {op!r}: requant[{key!r}] requantizes to qint8 / qint16, got {d.name}")


def _check_add(op: str, what: str, p: tuple[bool, int, int, int, int] | None) -> None:
    if p is None:
        return
    _, shift, qscale, mult, out_shift = p
    check_int(op, f"{what} shift", shift, 0, 23)
    check_int(op, f"{what} qscale", qscale, -32767, 32767)
    check_int(op, f"{what} multiplier", mult, -(2**31) + 1, 2**31 - 1)
    check_int(op, f"{what} out_shift", out_shift, 0, 62)


def _linear_state(op: str, types: dict[str, Type], proj: str, n_in: int, n_out: int) -> None:
    w, b = types[f"{proj}.weight"], types[f"{proj}.bias"]
    if not isinstance(w, TensorType) or w.shape != (n_out, n_in) or w.dtype.is_float:
        raise IRError(f"op {op!r}: {proj}.weight must be ({n_out}, {n_in}) integer codes, got {w}")
    if not isinstance(b, TensorType) or b.numel != n_out or b.dtype.is_float:
        raise IRError(f"op {op!r}: {proj}.bias must hold {n_out} integers, got {b}")
    for r in ("multiplier", "shift"):
        t = types[f"{proj}.{r}"]
        if not isinstance(t, TensorType) or t.numel not in (1, n_out) or t.dtype.is_float:
            raise IRError(f"op {op!r}: {proj}.{r} must hold 1 or {n_out} integers, got {t}")


def _table(op: str, role: str, t: Type) -> None:
    if not isinstance(t, TensorType) or t.shape != (256,) or t.dtype.is_float:
        raise IRError(f"op {op!r}: {role} must hold 256 integer entries, got {t}")


def _spec_of(m: Any, buffer: str, dtype: Any) -> QuantSpec:
    return QuantSpec((per_tensor_scale(m, buffer),), DType(dtype))


@attrs.frozen
class _SequenceOp(IntegerModuleOp):
    """A layer with several results; its module call has structure (a state pair, keywords)."""

    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    march: str
    requant: tuple[tuple[str, int, int, DType], ...] = attrs.field(converter=_requant)

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(inputs), {}

    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        module = self.to_module(dict(zip(self.param_roles(), self.module_params(operands), strict=True)))
        args, kwargs = self.module_call(self.module_inputs(operands))
        return module(*args, **kwargs)

    def requant_dict(self) -> dict[str, tuple[int, int, DType]]:
        return {k: (m, s, d) for k, m, s, d in self.requant}

    def state_types(self, operand_types: Sequence[Type]) -> dict[str, Type]:
        return dict(zip(self.param_roles(), operand_types[self.num_inputs() :], strict=True))

    def linears(self, operand_types: Sequence[Type]) -> list[tuple[str, Type, DType]]:
        """``(projection, its input's type, its output dtype)`` of each integer linear."""
        raise NotImplementedError(f"{type(self).__name__} names its integer linears")

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """Each integer linear's requantization state (:func:`check_linear_state`)."""
        for proj, x, out in self.linears(operand_types):
            check_linear_state(self.name, state, x, out, prefix=f"{proj}.")


@register_op
@attrs.frozen
class QLstmCell(_SequenceOp):
    """The integer LSTM cell: ``(input[, h, c])`` -> ``(h', c')``; with ``in_scales`` of x, h and
    c it was converted for calls with a state, with that of x alone for calls without one.

    ``whole_hx``: the call passes the state as one value, another cell's whole ``(h', c')``
    (``cell1(x, cell0(x0))``): the operands are ``(input, hx)`` and ``hx``'s two elements are h and c."""

    name: ClassVar[str] = "qlstm_cell"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "h", "c")

    cell: QuantSpec
    input_size: int
    hidden_size: int
    ih_out: QuantSpec
    has_bias: bool = True
    hh_out: QuantSpec | None = None
    gates_add: tuple[bool, int, int, int, int] | None = attrs.field(default=None, converter=_add)
    cell_add: tuple[bool, int, int, int, int] | None = attrs.field(default=None, converter=_add)
    whole_hx: bool = False

    def __attrs_post_init__(self) -> None:
        check_march(self.name, self.march)
        if len(self.in_scales) not in (1, 3):
            raise IRError(f"qlstm_cell: in_scales are those of x, or of x, h and c; got {self.in_scales}")
        state = self.has_state
        if not isinstance(self.whole_hx, bool) or (self.whole_hx and not state):
            raise IRError(
                f"qlstm_cell: whole_hx (the state passed as one (h, c) value) is a boolean, true only for a cell "
                f"converted for calls with a state; got {self.whole_hx!r} with in_scales {self.in_scales}"
            )
        if (self.hh_out is None, self.gates_add is None, self.cell_add is None) != (not state,) * 3:
            raise IRError(
                "qlstm_cell: hh_out, gates_add and cell_add are set exactly when the cell takes (h, c) "
                f"(in_scales of x, h and c), got in_scales {self.in_scales}"
            )
        check_int(self.name, "input_size", self.input_size, 1, 1 << 20)
        check_int(self.name, "hidden_size", self.hidden_size, 1, 1 << 20)
        _per_tensor(self.name, "out", self.out, (DType.qint8, DType.qint16))
        _per_tensor(self.name, "cell", self.cell, (DType.qint8, DType.qint16))
        _per_tensor(self.name, "ih_out", self.ih_out, (DType.qint8,))
        _per_tensor(self.name, "hh_out", self.hh_out, (DType.qint8,))
        _check_add(self.name, "gates_add", self.gates_add)
        _check_add(self.name, "cell_add", self.cell_add)
        steps = {"ig", "c8", "h"} | ({"fc"} if state else set())
        _check_requant(self.name, self.requant, steps)
        if self.requant_dict()["c8"][2] is not DType.qint8:
            raise IRError("qlstm_cell: requant['c8'] rescales the cell onto the qint8 tanh table input")

    @property
    def has_state(self) -> bool:
        return len(self.in_scales) == 3

    def num_inputs(self) -> int:
        return (2 if self.whole_hx else 3) if self.has_state else 1

    def state_operand_types(self, operand_types: Sequence[Type]) -> tuple[Type, Type] | None:
        """The types of h and c (the elements of ``hx`` when ``whole_hx``), or None without a state."""
        if not self.has_state:
            return None
        if not self.whole_hx:
            return operand_types[1], operand_types[2]
        hx = operand_types[1]
        if not (isinstance(hx, SequenceType) and len(hx.elements) == 2):
            raise IRError(f"qlstm_cell: hx must be a pair (h, c) (another cell's whole output), got {hx}")
        return hx.elements[0], hx.elements[1]

    def param_roles(self) -> tuple[str, ...]:
        hh = linear_roles("hh") if self.has_state else ()
        return (*linear_roles("ih"), *hh, "sigmoid_table", "tanh_g_table", "tanh_c_table")

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QLstmCell, list[Value]]:
        """Bind ``forward(x, hx=None)`` with ``hx`` a pair ``(h, c)``, in the form the cell was converted for."""
        if len(args) > 2 or set(kwargs) - {"x", "input", "hx"}:
            raise IRError(f"qlstm_cell binds forward(x, hx=None), got {len(args)} args and {sorted(kwargs)}")
        call = dict(zip(("x", "hx"), args, strict=False)) | kwargs
        x, hx = call.get("x", call.get("input")), call.get("hx")
        if not isinstance(x, Value):
            raise IRError("qlstm_cell: the input must be a graph value")
        if (hx is not None) != self.has_state:
            raise IRError(
                f"qlstm_cell: the cell was converted for calls {'with' if self.has_state else 'without'} (h, c) "
                f"and is called {'without' if hx is None else 'with'} them; use one module instance per call form"
            )
        if hx is None:
            return self, [x]
        if isinstance(hx, Value) and isinstance(hx.type, SequenceType) and len(hx.type.elements) == 2:
            return attrs.evolve(self, whole_hx=True), [x, hx]  # another cell's whole (h', c')
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(v, Value) for v in hx)):
            raise IRError("qlstm_cell: hx must be a pair of graph values (h, c), or one value holding the pair")
        return attrs.evolve(self, whole_hx=False), [x, hx[0], hx[1]]

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self.has_state:
            return (inputs[0],), {}
        return (inputs[0], inputs[1] if self.whole_hx else (inputs[1], inputs[2])), {}

    def typed_result(self, t: Type) -> Type:
        if isinstance(t, SequenceType) and len(t.elements) == 2:
            h, c = t.elements
            if isinstance(h, TensorType) and isinstance(c, TensorType):
                return SequenceType((self._typed(h, self.out), self._typed(c, self.cell)), t.kind)
        return t

    @staticmethod
    def _typed(t: TensorType, spec: QuantSpec) -> TensorType:
        return TensorType(t.shape, spec.dtype, spec)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "in_scales", self.in_scales)
        x = operand_types[0]
        if code_dtype(self.name, x) is DType.qint32 or not isinstance(x, TensorType) or x.rank != 2:
            raise IRError(f"qlstm_cell takes (batch, {self.input_size}) qint8 / qint16 codes, got {x}")
        if x.shape[1] != self.input_size:
            raise IRError(f"qlstm_cell takes (batch, {self.input_size}) codes, got {x}")
        hc = self.state_operand_types(operand_types)
        if hc is not None:  # h and c are read at their own scales (in_scales), whatever their dtype
            for t, what in zip(hc, ("h", "c"), strict=True):
                if code_dtype(self.name, t) is DType.qint32 or not isinstance(t, TensorType):
                    raise IRError(f"qlstm_cell: {what} must be qint8 / qint16 codes, got {t}")
                if t.shape != (x.shape[0], self.hidden_size):
                    raise IRError(f"qlstm_cell: {what} must be (batch, {self.hidden_size}) codes, got {t}")
        types = self.state_types(operand_types)
        _linear_state(self.name, types, "ih", self.input_size, 4 * self.hidden_size)
        if self.has_state:
            _linear_state(self.name, types, "hh", self.hidden_size, 4 * self.hidden_size)
        for role in ("sigmoid_table", "tanh_g_table", "tanh_c_table"):
            _table(self.name, role, types[role])

    def linears(self, operand_types: Sequence[Type]) -> list[tuple[str, Type, DType]]:
        ih = [("ih", operand_types[0], self.ih_out.dtype)]
        hc = self.state_operand_types(operand_types)
        return ih + ([("hh", hc[0], self.hh_out.dtype)] if hc is not None and self.hh_out is not None else [])

    def float_op(self) -> Op:
        return float_ops.LstmCell(bias=self.has_bias, has_state=self.has_state)

    @classmethod
    def from_module(cls, m: Any) -> QLstmCell:
        n = int(m.num_input_scales)
        hh = m.hh
        return cls(
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=tuple(per_tensor_scale(m, f"input_scale_{i}") for i in range(n)),
            march=str(m.march),
            requant={k: (m_, s, m.dtypes[k]) for k, (m_, s) in m.rq.items()},
            cell=_spec_of(m, "cell_scale", m.cell_dtype),
            input_size=int(m.input_size),
            hidden_size=int(m.hidden_size),
            has_bias=bool(m.has_bias),
            ih_out=QuantSpec((per_tensor_scale(m.ih, "scale"),), m.ih.dtype),
            hh_out=None if hh is None else QuantSpec((per_tensor_scale(hh, "scale"),), hh.dtype),
            gates_add=m.gates_add,
            cell_add=m.cell_add,
        )


_PROJS = ("q_proj", "k_proj", "v_proj", "out_proj")


@register_op
@attrs.frozen
class QMultiheadAttention(_SequenceOp):
    """Integer multi-head attention: ``(query, key, value[, key_padding_mask][, attn_mask])`` ->
    ``(output, weights)``, ``weights`` None unless ``need_weights``. Masks are graph values or
    constants: bool (True: excluded) or float (``-inf`` excluded, finite entries added as codes
    on the scores' grid)."""

    name: ClassVar[str] = "qmultihead_attention"
    operand_names: ClassVar[tuple[str, ...]] = ("query", "key", "value")

    embed_dim: int
    num_heads: int
    proj_outs: tuple[QuantSpec, ...] = attrs.field(converter=_specs)
    context: QuantSpec
    scores: QuantSpec
    softmax: QuantSpec
    softmax_multiplier: int
    softmax_shift: int
    weights: QuantSpec
    batch_first: bool = False
    has_bias: bool = True
    softmax_dim: int = -1
    need_weights: bool = True
    average_attn_weights: bool = True
    key_padding_mask: bool = False
    attn_mask: bool = False

    def __attrs_post_init__(self) -> None:
        check_march(self.name, self.march)
        check_int(self.name, "embed_dim", self.embed_dim, 1, 1 << 16)
        check_int(self.name, "num_heads", self.num_heads, 1, self.embed_dim)
        if self.embed_dim % self.num_heads:
            raise IRError(
                f"qmultihead_attention: embed_dim {self.embed_dim} is not divisible by {self.num_heads} heads"
            )
        if len(self.in_scales) != 3:
            raise IRError(f"qmultihead_attention: in_scales are those of query, key and value, got {self.in_scales}")
        if len(self.proj_outs) != 3:
            raise IRError(f"qmultihead_attention: proj_outs are the q / k / v projections' specs, got {self.proj_outs}")
        for what, spec in (("out", self.out), ("context", self.context), ("softmax", self.softmax)):
            _per_tensor(self.name, what, spec, (DType.qint8, DType.qint16))
        _per_tensor(self.name, "weights", self.weights, (DType.qint8, DType.qint16))
        for i, spec in enumerate(self.proj_outs):
            _per_tensor(self.name, f"proj_outs[{i}]", spec, (DType.qint8, DType.qint16))
        _per_tensor(self.name, "scores", self.scores, (DType.qint8,))
        check_int(self.name, "softmax_dim", self.softmax_dim, -4, 3)
        check_int(self.name, "softmax_multiplier", self.softmax_multiplier, 0, 2**31 - 1)
        check_int(self.name, "softmax_shift", self.softmax_shift, 0, 62)
        _check_requant(self.name, self.requant, {"scores", "context", "weights_mean", "weights"})
        if self.requant_dict()["scores"][2] is not DType.qint8:
            raise IRError("qmultihead_attention: requant['scores'] requantizes onto the softmax's qint8 table input")

    def num_inputs(self) -> int:
        return 3 + int(self.key_padding_mask) + int(self.attn_mask)

    def param_roles(self) -> tuple[str, ...]:
        return (*(r for p in _PROJS for r in linear_roles(p)), "softmax.table")

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QMultiheadAttention, list[Value]]:
        """Bind ``forward(query, key, value, key_padding_mask, need_weights, attn_mask,
        average_attn_weights, is_causal)``; masks must be graph values (inputs or constants)."""
        return float_ops.bind_quantized_attention(self, args, kwargs)

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return float_ops.quantized_attention_call(self, inputs)

    def masks(self, inputs: Sequence[Any]) -> dict[str, Any]:
        """The mask operands by role (``attn_mask``, ``key_padding_mask``), in the call's order."""
        _, kwargs = self.module_call(inputs)
        return {r: kwargs[r] for r in ("attn_mask", "key_padding_mask") if kwargs[r] is not None}

    def typed_result(self, t: Type) -> Type:
        if isinstance(t, SequenceType) and t.elements and isinstance(t.elements[0], TensorType):
            out = TensorType(t.elements[0].shape, self.out.dtype, self.out)
            rest = list(t.elements[1:])
            if rest and isinstance(rest[0], TensorType):
                rest[0] = TensorType(rest[0].shape, self.weights.dtype, self.weights)
            return SequenceType((out, *rest), t.kind)
        return t

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "in_scales", self.in_scales)
        e = self.embed_dim
        for what, t in zip(("query", "key", "value"), operand_types[:3], strict=True):
            code_dtype(self.name, t)
            if not isinstance(t, TensorType) or t.rank != 3 or t.shape[-1] != e:
                raise IRError(f"qmultihead_attention: {what} must be 3-dimensional codes (..., {e}), got {t}")
        for t in operand_types[3 : self.num_inputs()]:
            if not isinstance(t, TensorType) or t.dtype.is_quantized:
                raise IRError(f"qmultihead_attention: a mask must be a bool or float tensor, got {t}")
        types = self.state_types(operand_types)
        for p in _PROJS:
            _linear_state(self.name, types, p, e, e)
        _table(self.name, "softmax.table", types["softmax.table"])

    def linears(self, operand_types: Sequence[Type]) -> list[tuple[str, Type, DType]]:
        projs = [(p, operand_types[i], self.proj_outs[i].dtype) for i, p in enumerate(_PROJS[:3])]
        return [*projs, ("out_proj", TensorType((1,), self.context.dtype), self.out.dtype)]

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """The projections' requantization state and the softmax exp table."""
        super().verify_state(operand_types, state)
        if "softmax.table" in state:
            k = operand_types[1]  # a softmax row holds one score per key: its source length
            n = k.shape[1 if self.batch_first else 0] if isinstance(k, TensorType) and k.rank == 3 else 1
            table = state["softmax.table"]
            check_exp_table(self.name, "softmax.table", table, n, self.softmax_multiplier, self.softmax_shift)

    def float_op(self) -> Op:
        return float_ops.MultiheadAttention(
            embed_dim=self.embed_dim, num_heads=self.num_heads, bias=self.has_bias, batch_first=self.batch_first
        )

    @classmethod
    def from_module(cls, m: Any) -> QMultiheadAttention:
        sm = m.softmax
        if per_tensor_scale(m.out_proj, "scale") != per_tensor_scale(m, "scale") or m.out_proj.dtype is not m.dtype:
            raise NotImplementedError("MultiheadAttention: out_proj's output spec differs from the layer's output")
        return cls(
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=tuple(per_tensor_scale(m, f"input_scale_{i}") for i in range(3)),
            march=str(m.march),
            requant={k: (m_, s, m.dtypes[k]) for k, (m_, s) in m.rq.items()},
            embed_dim=int(m.embed_dim),
            num_heads=int(m.num_heads),
            batch_first=bool(m.batch_first),
            has_bias=bool(m.has_bias),
            proj_outs=tuple(_spec_of(getattr(m, p), "scale", getattr(m, p).dtype) for p in _PROJS[:3]),
            context=_spec_of(m.out_proj, "input_scale_0", m.dtypes["context"]),
            scores=_spec_of(sm, "input_scale_0", DType.qint8),
            softmax=_spec_of(sm, "scale", sm.dtype),
            softmax_dim=int(sm.dim),
            softmax_multiplier=int(sm.multiplier),
            softmax_shift=int(sm.shift),
            weights=_spec_of(m, "weights_scale", m.dtypes["weights"]),
        )
