"""Rewrite an exported QDQ graph into the layout onnxruntime fuses into integer kernels.

:func:`qir.utils.onnx_helper.export_to_onnx` writes each fake quant as ``QuantizeLinear ->
DequantizeLinear`` where qir has it: a weight as ``Q(float initializer) -> DQ``, a conv + ReLU
as ``DQ -> Conv -> Relu -> Q``, a fused conv + add as ``Conv -> Add -> Relu -> Q``. onnxruntime's
QDQ transformer only turns ``DQ -> op -> Q`` groups into ``QLinearConv`` / ``QLinearMatMul`` /
``QLinearAdd``, and only where every input of the op (the bias too) comes from a
DequantizeLinear, a ReLU between the op and the Q is implied by the Q's range, and (on x86)
activations are uint8. The rewrites below produce those groups (docs/onnx.md, "The onnxruntime
layout"); they run in this order:

1. weights: ``Q(float w) -> DQ`` becomes an int8/int16 initializer (qir's codes, rounded half up)
   ``-> DQ``;
2. conv / linear bias: a float bias becomes an int32 initializer at ``s_in * s_w`` (qir's
   ``quantize_bias``) ``-> DQ``;
3. ``op -> Relu -> Q(int8, zero point 0)`` becomes ``op -> Relu -> Q(uint8, zero point 0) ->
   Clip(0, 127) -> DQ``: the uint8 Q makes the ReLU redundant, and the integer Clip restores
   qir's int8 ceiling, so the values are unchanged; a ReLU6 (``Clip(0, 6)``) becomes
   ``op -> Q(uint8, 0) -> Clip(0, Q(6))`` the same way;
4. ``DQ -> MaxPool`` becomes ``MaxPool -> DQ`` on the integer codes (exact);
5. a conv / linear whose output only feeds an ``Add`` (qir's fused conv + add) gets its own
   ``Q -> DQ`` at the smallest scale where clipping it never changes the output
   (:func:`_intermediate_scale`): **not exact**, one extra rounding (docs/onnx.md);
6. the remaining int8 activation pairs ``Q(int8, 0) -> DQ`` become ``Q(uint8, 128) -> DQ(uint8,
   128)`` (the same values).

Everything but step 5 keeps the values the default layout computes; step 2 gives qir's integer
bias instead of the fake-quant model's float one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["OrtLayoutReport", "ort_fusable_layout"]

_INT_RANGE = {"INT8": (-128, 127), "UINT8": (0, 255), "INT16": (-32768, 32767), "UINT16": (0, 65535)}
_NP = {"INT8": np.int8, "UINT8": np.uint8, "INT16": np.int16, "UINT16": np.uint16, "INT32": np.int32}
_WEIGHTED = ("Conv", "Gemm", "MatMul")
# ops that move elements without changing them: a per-tensor scale holds across them
_MOVES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose")


@dataclass
class OrtLayoutReport:
    """What :func:`ort_fusable_layout` rewrote, by kind; ``inexact`` names the approximated ops."""

    weights: int = 0
    biases: int = 0
    relus: int = 0
    max_pools: int = 0
    conv_adds: int = 0
    activations: int = 0
    inexact: list[str] = field(default_factory=list)


class _Rewriter:
    def __init__(self, model: Any) -> None:
        import onnx_ir as ir

        self.ir = ir
        self.graph = model.graph
        self.report = OrtLayoutReport()
        self._replaced: list[Any] = []
        self._names: set[str] = {v.name for v in self.graph.initializers.values() if v.name}
        self._names |= {o.name for n in self.graph.all_nodes() for o in n.outputs if o.name}

    # -- small builders --------------------------------------------------------------------

    def _fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def _initializer(self, base: str, array: np.ndarray) -> Any:
        ir = self.ir
        name = self._fresh(base)
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.type = ir.TensorType(value.const_value.dtype)
        value.shape = ir.Shape(array.shape)
        self.graph.register_initializer(value)
        return value

    def _node(self, op: str, inputs: list[Any], base: str, like: Any, dtype: Any = None, **attrs: int) -> Any:
        """A node with one output named after ``base``, shaped like ``like`` (dtype ``dtype`` or ``like``'s)."""
        ir = self.ir
        attributes = [ir.AttrInt64(k, v) for k, v in attrs.items()]
        node = ir.Node("", op, inputs, attributes, num_outputs=1, name=self._fresh(f"node_{base}"))
        out = node.outputs[0]
        out.name = self._fresh(base)
        out.type = ir.TensorType(dtype if dtype is not None else like.dtype)
        out.shape = like.shape
        return node

    # -- readers ---------------------------------------------------------------------------

    @staticmethod
    def _const(value: Any) -> np.ndarray | None:
        if value is None or value.const_value is None:
            return None
        return np.asarray(value.const_value.numpy())

    def _qdq_params(self, node: Any) -> tuple[np.ndarray, int, str, int | None] | None:
        """``(scale, zero point, quantized dtype name, axis)`` of a Q or DQ with constant parameters."""
        scale = self._const(node.inputs[1])
        if scale is None:
            return None
        zp_value = node.inputs[2] if len(node.inputs) > 2 else None
        if node.op_type == "QuantizeLinear":  # the zero point's type is the quantized type (uint8 without one)
            qtype = zp_value.dtype.name if zp_value is not None and zp_value.dtype is not None else "UINT8"
        else:
            qtype = node.inputs[0].dtype.name if node.inputs[0].dtype is not None else ""
        zp = self._const(zp_value)
        if zp_value is not None and zp is None:
            return None
        if zp is not None and np.any(zp != zp.reshape(-1)[0]):
            return None
        axis_attr = node.attributes.get("axis")
        axis = int(axis_attr.value) if axis_attr is not None and scale.ndim == 1 else None
        return scale.astype(np.float32), 0 if zp is None else int(zp.reshape(-1)[0]), qtype, axis

    @staticmethod
    def _only_use(value: Any) -> Any:
        uses = list(value.uses())
        if len(uses) != 1 or value.is_graph_output():
            return None
        return uses[0].node

    def _producer(self, value: Any, op: str) -> Any:
        node = value.producer() if value is not None else None
        return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None

    def _dq_through_shape_ops(self, value: Any) -> Any:
        """The DequantizeLinear ``value`` comes from, looking through ops that only move elements."""
        node = value.producer() if value is not None else None
        while node is not None and node.op_type in _MOVES and node.domain in ("", "ai.onnx"):
            node = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    # -- 1. weights --------------------------------------------------------------------------

    def weights(self) -> None:
        for q in [n for n in self.graph if n.op_type == "QuantizeLinear"]:
            w = self._const(q.inputs[0])
            params = self._qdq_params(q)
            if w is None or params is None or not q.inputs[0].is_initializer() or params[2] not in _INT_RANGE:
                continue
            scale, zp, qtype, axis = params
            dqs = [u.node for u in q.outputs[0].uses()]
            if not dqs or any(d.op_type != "DequantizeLinear" for d in dqs) or q.outputs[0].is_graph_output():
                continue
            if zp != 0:
                continue  # qir's zero points are 0; leave anything else as written
            s = scale if axis is None else scale.reshape([-1 if d == axis else 1 for d in range(w.ndim)])
            lo, hi = _INT_RANGE[qtype]
            # qir's rounding (half up, in float32 as its fake quant computes x / scale)
            codes = np.clip(np.floor(w.astype(np.float32) / s + np.float32(0.5)), lo, hi).astype(_NP[qtype])
            name = q.inputs[0].name or "weight"
            init = self._initializer(f"{name}_quantized", codes)
            for dq in dqs:
                dq.replace_input_with(0, init)
            self._replaced += [q.inputs[0], q.inputs[2]]
            self.graph.remove(q, safe=True)
            self.report.weights += 1

    # -- 2. biases ---------------------------------------------------------------------------

    def biases(self) -> None:
        for node in [n for n in self.graph if n.op_type in ("Conv", "Gemm")]:
            if len(node.inputs) < 3 or node.inputs[2] is None:
                continue
            bias = self._const(node.inputs[2])
            dq_x = self._dq_through_shape_ops(node.inputs[0])
            dq_w = self._producer(node.inputs[1], "DequantizeLinear")
            if bias is None or dq_x is None or dq_w is None or bias.dtype.kind != "f" or bias.ndim != 1:
                continue
            px, pw = self._qdq_params(dq_x), self._qdq_params(dq_w)
            if px is None or pw is None or px[3] is not None or pw[1] != 0:
                continue
            if node.op_type == "Gemm" and not self._plain_gemm(node, pw[3]):
                continue
            # qir's quantize_bias: sat_int32(round_half_up(b / (s_in * s_w))) in float64
            s_acc = np.float64(px[0]) * pw[0].astype(np.float64)
            codes = np.floor(bias.astype(np.float64) / s_acc + 0.5)
            codes = np.clip(codes, -(2**31), 2**31 - 1).astype(np.int32)
            init = self._initializer(f"{node.inputs[2].name or 'bias'}_quantized", codes)
            scale = self._initializer(f"{node.inputs[2].name or 'bias'}_scale", s_acc.astype(np.float32))
            attrs = {"axis": 0} if s_acc.ndim == 1 else {}
            dq = self._node(
                "DequantizeLinear", [init, scale], f"{node.inputs[2].name or 'bias'}_dq", node.inputs[2], **attrs
            )
            dq.outputs[0].type = self.ir.TensorType(self.ir.DataType.FLOAT)
            self._replaced.append(node.inputs[2])
            self.graph.insert_before(node, dq)
            node.replace_input_with(2, dq.outputs[0])
            self.report.biases += 1

    @staticmethod
    def _plain_gemm(node: Any, w_axis: int | None) -> bool:
        """Y = A B^T + C with alpha = beta = 1 and a per-output-channel (axis 0) weight scale."""
        a = {k: v.value for k, v in node.attributes.items()}
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0) != 0:
            return False
        return w_axis is None or w_axis == (0 if a.get("transB", 0) else 1)

    # -- 3. ReLU before an int8 Q ------------------------------------------------------------

    def _relu_ceiling(self, node: Any, scale: np.ndarray) -> int | None:
        """The top code of a ReLU (127) or of a ``Clip(0, hi)`` such as ReLU6 at ``scale``; None otherwise."""
        if node.op_type == "Relu":
            return 127
        if node.op_type != "Clip" or scale.ndim != 0:
            return None
        bounds = [self._const(v) for v in (*node.inputs[1:3], None, None)][:2]
        if bounds[0] is None or float(bounds[0]) != 0.0:
            return None
        if bounds[1] is None:
            return 127
        # Q(clip(y, 0, hi)) = clip(Q(y), 0, Q(hi)): Q rounds monotonically; as onnxruntime computes
        # Q(hi) (float32 division, ties to even), so the codes equal the graph's as written
        top = np.round(np.float32(bounds[1]) / np.float32(scale))
        return int(np.clip(top, 0, 127))

    def relus(self) -> None:
        ir = self.ir
        for relu in [n for n in self.graph if n.op_type in ("Relu", "Clip")]:
            q = self._only_use(relu.outputs[0])
            if q is None or q.op_type != "QuantizeLinear" or q.inputs[0] is not relu.outputs[0]:
                continue
            params = self._qdq_params(q)
            if params is None or params[2] != "INT8" or params[1] != 0 or q.outputs[0].is_graph_output():
                continue
            ceiling = self._relu_ceiling(relu, params[0])
            consumers = [u.node for u in q.outputs[0].uses()]
            if ceiling is None or not consumers:
                continue
            if any(c.op_type != "DequantizeLinear" or len(c.inputs) > 2 for c in consumers):
                continue
            scale_shape = params[0].shape
            zp = self._initializer(f"{q.inputs[1].name or 'relu'}_zero_point_u8", np.zeros(scale_shape, np.uint8))
            self._replaced.append(q.inputs[2])
            q.replace_input_with(2, zp)
            q.outputs[0].type = ir.TensorType(ir.DataType.UINT8)
            if relu.op_type == "Clip":
                # onnxruntime fuses only a ReLU or a Clip that the Q's range implies: the integer
                # Clip below does the float one's work, so the float one goes
                q.replace_input_with(0, relu.inputs[0])
                self.graph.remove(relu, safe=True)
            lo = self._initializer("relu_clip_min_u8", np.array(0, np.uint8))
            hi = self._initializer("relu_clip_max_u8", np.array(ceiling, np.uint8))
            clip = self._node("Clip", [q.outputs[0], lo, hi], f"{q.outputs[0].name}_ceiling", q.outputs[0])
            self.graph.insert_after(q, clip)
            for dq in consumers:
                dq.replace_input_with(0, clip.outputs[0])
            self.report.relus += 1

    # -- 4. max pools on codes ---------------------------------------------------------------

    def max_pools(self) -> None:
        ir = self.ir
        for pool in [n for n in self.graph if n.op_type == "MaxPool"]:
            dq = self._producer(pool.inputs[0], "DequantizeLinear")
            params = self._qdq_params(dq) if dq is not None else None
            if params is None or len(pool.outputs) != 1 or params[3] is not None:
                continue  # per-channel activations: MaxPool on codes would compare different scales
            codes = dq.inputs[0]
            if codes.dtype is None or codes.dtype.name != "UINT8":
                continue
            out = pool.outputs[0]
            new_pool = ir.Node(
                "",
                "MaxPool",
                [codes],
                list(pool.attributes.values()),
                num_outputs=1,
                name=self._fresh(pool.name or "pool"),
            )
            new_pool.outputs[0].name = self._fresh(f"{out.name}_codes")
            new_pool.outputs[0].type = ir.TensorType(codes.dtype)
            new_pool.outputs[0].shape = out.shape
            new_dq = self._node("DequantizeLinear", [new_pool.outputs[0], *dq.inputs[1:]], f"{out.name}_dq", out)
            for k, v in dq.attributes.items():
                new_dq.attributes[k] = v
            self.graph.insert_after(pool, [new_pool, new_dq])
            out.replace_all_uses_with(new_dq.outputs[0], replace_graph_outputs=True)
            self.graph.remove(pool, safe=True)
            if not list(dq.outputs[0].uses()) and not dq.outputs[0].is_graph_output():
                self.graph.remove(dq, safe=True)
            self.report.max_pools += 1

    # -- 5. fused conv + add -----------------------------------------------------------------

    def conv_adds(self) -> None:
        ir = self.ir
        for node in [n for n in self.graph if n.op_type in _WEIGHTED]:
            add = self._only_use(node.outputs[0])
            if add is None or add.op_type != "Add":
                continue
            other = add.inputs[1] if add.inputs[0] is node.outputs[0] else add.inputs[0]
            dq_other = self._producer(other, "DequantizeLinear")
            out = self._only_use(add.outputs[0])
            relu = out is not None and out.op_type == "Relu"
            if out is not None and relu:
                out = self._only_use(out.outputs[0])
            if dq_other is None or out is None or out.op_type != "QuantizeLinear":
                continue
            p_other, p_out = self._qdq_params(dq_other), self._qdq_params(out)
            if p_other is None or p_out is None or p_other[3] is not None or p_out[3] is not None:
                continue
            if p_out[1] != 0 or p_out[2] not in ("INT8", "UINT8"):
                continue  # int16 outputs: onnxruntime has no int16 QLinearAdd, keep the exact form
            lo, hi = self._code_range(dq_other)
            s_mid = _intermediate_scale(float(p_out[0]), lo * float(p_other[0]), hi * float(p_other[0]), relu)
            scale = self._initializer(f"{node.outputs[0].name}_scale", np.array(s_mid, np.float32))
            zp = self._initializer(f"{node.outputs[0].name}_zero_point", np.array(0, np.int8))
            q = self._node(
                "QuantizeLinear",
                [node.outputs[0], scale, zp],
                f"{node.outputs[0].name}_q",
                node.outputs[0],
                ir.DataType.INT8,
            )
            dq = self._node("DequantizeLinear", [q.outputs[0], scale], f"{node.outputs[0].name}_dq", node.outputs[0])
            self.graph.insert_after(node, [q, dq])
            add.replace_input_with(list(add.inputs).index(node.outputs[0]), dq.outputs[0])
            self.report.conv_adds += 1
            self.report.inexact.append(node.name or node.outputs[0].name or "?")

    def _code_range(self, dq: Any) -> tuple[int, int]:
        """The codes (minus the zero point) ``dq`` can see: its type's range, narrowed by a constant
        Clip upstream (through max pools and element moves), as the ReLU rewrite leaves."""
        params = self._qdq_params(dq)
        assert params is not None
        lo, hi = _INT_RANGE.get(params[2], (-(2**31), 2**31 - 1))
        node = dq.inputs[0].producer()
        while node is not None and node.op_type in ("MaxPool", *_MOVES):
            node = node.inputs[0].producer() if node.inputs[0] is not None else None
        if node is not None and node.op_type == "Clip":
            low, high = [self._const(v) for v in (*node.inputs[1:3], None, None)][:2]
            lo = lo if low is None else max(lo, int(low))
            hi = hi if high is None else min(hi, int(high))
        return lo - params[1], hi - params[1]

    # -- 6. int8 activations as uint8 -------------------------------------------------------

    def activations_to_uint8(self) -> None:
        """``Q(int8, 0) -> DQ`` on activations becomes ``Q(uint8, 128) -> DQ(uint8, 128)``: the same values.

        onnxruntime's x86 kernels take uint8 activations; it converts int8 Q -> DQ pairs itself,
        but not the Q/DQ it copies across a Reshape, so a linear after a flatten would see int8
        on one side and uint8 on the other, and stay float.
        """
        ir = self.ir
        for q in [n for n in self.graph if n.op_type == "QuantizeLinear"]:
            params = self._qdq_params(q)
            if params is None or params[2] != "INT8" or params[1] != 0 or q.inputs[0].const_value is not None:
                continue
            dqs = [u.node for u in q.outputs[0].uses()]
            if not dqs or q.outputs[0].is_graph_output():
                continue
            if any(d.op_type != "DequantizeLinear" or len(d.inputs) > 2 for d in dqs):
                continue
            zp = self._initializer(
                f"{q.inputs[1].name or 'act'}_zero_point_u8_128", np.full(params[0].shape, 128, np.uint8)
            )
            self._replaced.append(q.inputs[2])
            q.replace_input_with(2, zp)
            q.outputs[0].type = ir.TensorType(ir.DataType.UINT8)
            for dq in dqs:
                dq.resize_inputs(3)
                dq.replace_input_with(2, zp)
            self.report.activations += 1

    def drop_replaced_initializers(self) -> None:
        """Drop the initializers the rewrites replaced (float weights and biases, int8 zero points)
        that nothing uses any more: onnxruntime warns about each unused one."""
        for value in self._replaced:
            name = value.name
            if name in self.graph.initializers and self.graph.initializers[name] is value:
                if not list(value.uses()) and not value.is_graph_output() and not value.is_graph_input():
                    self.graph.initializers.pop(name)


def _intermediate_scale(s_out: float, o_lo: float, o_hi: float, relu: bool) -> np.float32:
    """The scale of the int8 code a fused conv + add's conv output gets (output codes [-128, 127]).

    The smallest scale at which clipping the conv's value ``c`` to ``[-128, 127]`` codes never
    changes the output, given the other operand lies in ``[o_lo, o_hi]``: where ``c`` is cut
    at the top, ``127·s_mid + o_lo`` must already reach the output's top code 127; where it is
    cut at the bottom, ``-128·s_mid + o_hi`` must reach 0 under a ReLU, or the bottom code
    -128 without one. Only the rounding of ``c`` to this grid is then lost.
    """
    top = (127.0 * s_out - o_lo) / 127.0
    bottom = o_hi / 128.0 if relu else (128.0 * s_out + o_hi) / 128.0
    # a hair above, so float32 rounding of the scale cannot undo the bound
    return np.float32(max(top, bottom, s_out * 2.0**-8) * (1.0 + 2.0**-16))


def ort_fusable_layout(model: Any) -> OrtLayoutReport:
    """Rewrite ``model`` (an ``onnx_ir.Model`` from the export) in place; returns what changed."""
    r = _Rewriter(model)
    r.weights()
    r.relus()
    r.max_pools()
    r.conv_adds()
    r.activations_to_uint8()
    r.biases()
    r.drop_replaced_initializers()
    model.graph.sort()
    return r.report
