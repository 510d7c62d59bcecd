"""Static profile of a :class:`~backends.common.program.Program`: per-layer MACs, bytes, an
*estimated* time from the march's roofline (:mod:`backends.common.roofline`), and totals.

A *layer* is one model node (``Instruction.source``): a fused conv + add + relu is one
kernel call and one layer, counted once; a node lowered to several kernel calls (a cat
that rescales its inputs first) is one layer whose bytes are what enters and leaves it.

What is counted (docs/perf-and-visualize.md):

* MACs: conv ``N*Cout*Hout*Wout*Cin/groups*kh*kw`` (output elements times weight
  elements per output channel), transposed conv per input element, linear / matmul output
  elements times the reduced length; the float convs / linears of the CPU part (``float_fn``
  ``F.conv2d`` ...) likewise. Other kernels count no MACs.
* bytes moved: every tensor a layer reads from outside itself, every tensor it hands on
  (each tensor of a tuple output: topk's values and indices, split's pieces, a cell's (h, c)),
  and its parameters, at their integer widths (int8 = 1 byte ...). View-only shape ops
  (reshape, flatten, squeeze, ...) and picking an item of a tuple move nothing.
* parameter bytes: weights, biases, lookup tables and the constants the float part reads
  (a CPU conv's float weights). The requantization multipliers /
  shifts and the CPU kernels' index tables are left out: the Program holds them in CPU
  layouts (int64) whose hardware width is not public.
* the unit: a layer whose every tensor is a float-part value (float32, int64 index, bool mask)
  and that is no ``quantize`` / ``dequantize`` boundary is CPU work (the ``float_fn`` steps,
  layout and pooling on float values); it is estimated with the CPU's float rate
  (:func:`~backends.common.roofline.estimate_cpu_seconds`) and counts float operations: one per
  element of the largest tensor it reads or writes, ``n * ceil(log2 n)`` per sorted row of
  ``n`` for sort / argsort / topk, two per MAC, none for a view. Everything else is BPU work on
  the roofline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from backends.common.kernels.base import get_kernel
from backends.common.kernels.float_ops import FLOAT_MAC_LAYERS, FLOAT_VALUE_DTYPES
from backends.common.program import Instruction, Program, ValueRef, output_names
from backends.common.roofline import Roofline, estimate_cpu_seconds, estimate_seconds

__all__ = ["ESTIMATE_NOTE", "LayerProfile", "ProgramProfile", "ValueInfo", "profile_program", "value_infos"]

ESTIMATE_NOTE = (
    "ESTIMATE: times come from a roofline model at the march's peak rates (max of compute and DRAM "
    "time per layer; CPU float steps at the CPU's float rate), not from a measurement on the device"
)
_BOUNDARY = frozenset({"quantize", "dequantize"})
#: float_fn functions that sort along a dimension: n * ceil(log2 n) operations per row of n
_SORTS = frozenset({"sort", "argsort", "topk"})
#: float_fn functions that are layers (a hybrid model's CPU convs): counted as 2 operations per MAC
_FLOAT_LAYERS = frozenset(FLOAT_MAC_LAYERS)

#: Constant roles that are model parameters (the rest are requantization / CPU index tables); ``value``:
#: a tensor a ``constant`` instruction reads (a CPU float conv's weights, a decoder's anchor grid)
PARAM_ROLES = frozenset({"weight", "bias", "table", "value"})
#: shape_fn functions that only relabel a tensor's shape: no data moves.
VIEW_FNS = frozenset(
    {
        "flatten",
        "reshape",
        "view",
        "view_as",
        "reshape_as",
        "squeeze",
        "unsqueeze",
        "contiguous",
        "size",
        "dim",
        "numel",
        "detach",
        "clone",
        "add",
        "sub",
        "mul",
        "floordiv",
    }
)
#: ``ValueInfo.dtype`` of a tuple of tensors
TUPLE = "tuple"
_DTYPE_NAMES = {
    torch.int8: "qint8",
    torch.int16: "qint16",
    torch.int32: "qint32",
    torch.float32: "float32",
    torch.int64: "int64",
    torch.bool: "qbool",
    torch.uint8: "uint8",
}
#: the dtypes of the program's float part (float values, int64 indices, bool masks): a layer touching only
#: these, and no quantize / dequantize boundary, runs on the CPU
_FLOAT_PART = frozenset(_DTYPE_NAMES[d] for d in FLOAT_VALUE_DTYPES)


@dataclass(frozen=True)
class ValueInfo:
    """Shape and dtype of one tensor value of a Program run on the example inputs; for a tuple of
    tensors (topk's values and indices, split's pieces) ``dtype`` is ``tuple``, ``parts`` holds each
    tensor's (nested tuples kept), and ``nbytes`` is their sum."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    parts: tuple[ValueInfo, ...] = ()

    def leaves(self) -> list[ValueInfo]:
        """The tensors this value holds: itself, or a tuple's tensors in order."""
        if self.dtype != TUPLE:
            return [self]
        return [leaf for p in self.parts for leaf in p.leaves()]


def value_infos(program: Program, inputs: Sequence[torch.Tensor]) -> dict[str, ValueInfo]:
    """Run ``program`` once on ``inputs`` with its own kernels and keep every tensor's shape and dtype."""
    if len(inputs) != len(program.inputs):
        raise ValueError(f"the program takes {len(program.inputs)} input(s), got {len(inputs)}")
    env: dict[str, Any] = dict(zip(program.inputs, inputs, strict=True))
    infos: dict[str, ValueInfo] = {}
    uses: dict[str, int] = {}
    for inst in program.instructions:
        for v in inst.inputs:
            uses[v] = uses.get(v, 0) + 1
    for name, t in env.items():
        # a dict input (forward(self, data)) holds its tensors as a tuple does
        found = _info(t) if isinstance(t, torch.Tensor) else _tuple_info(list(t.values()) if isinstance(t, dict) else t)
        if found is None:
            raise TypeError(f"program input '{name}' holds no tensor: got {type(t).__name__}")
        infos[name] = found
    with torch.no_grad():
        for inst in program.instructions:
            kernel = get_kernel(inst.op)
            outs = kernel.run(inst, [env[v] for v in inst.inputs], kernel.prepare(inst, program.constants))
            for name, val in zip(inst.outputs, outs, strict=True):
                env[name] = val
                found = _info(val) if isinstance(val, torch.Tensor) else _tuple_info(val)
                if found is not None:
                    infos[name] = found
            for v in inst.inputs:  # drop values nobody reads again: resnet-sized runs stay small
                uses[v] -= 1
                if uses[v] == 0 and v not in program.inputs:
                    env.pop(v, None)
    return infos


def _info(t: Any) -> ValueInfo:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"program inputs must be tensors, got {type(t).__name__}")
    return ValueInfo(
        tuple(int(d) for d in t.shape), _DTYPE_NAMES.get(t.dtype, str(t.dtype)), t.numel() * t.element_size()
    )


def _tuple_info(val: Any) -> ValueInfo | None:
    """A tuple / list holding tensors (other items, like a shape's ints, hold no bytes); None without any."""
    if not isinstance(val, (tuple, list)) or isinstance(val, torch.Size):
        return None
    parts = [_info(x) if isinstance(x, torch.Tensor) else _tuple_info(x) for x in val]
    kept = tuple(p for p in parts if p is not None)
    if not kept:
        return None
    return ValueInfo((), TUPLE, sum(p.nbytes for p in kept), kept)


@dataclass
class LayerProfile:
    """One model node's share of the Program (see the module docstring for what is counted)."""

    name: str
    module: str
    kernels: list[str]
    macs: int
    weighted_macs: float
    input_bytes: int
    output_bytes: int
    param_bytes: int
    output_shape: list[int] | None
    output_dtype: str
    est_time_s: float
    bound: str
    #: ``BPU``, or ``CPU`` for the program's float part (see the module docstring)
    unit: str = "BPU"
    #: float operations of a CPU layer (0 on the BPU, whose work is MACs)
    float_ops: int = 0
    #: a layer whose output is a tuple (topk, split): each tensor's shape (``output_shape`` is then None
    #: and ``output_dtype`` lists their dtypes, comma-separated)
    output_shapes: list[list[int]] | None = None

    @property
    def bytes_moved(self) -> int:
        return self.input_bytes + self.output_bytes + self.param_bytes


@dataclass
class ProgramProfile:
    """Every layer plus totals. ``str()`` is the readable report; :meth:`to_json` the file content."""

    model: str
    roofline: Roofline
    batch: int
    opt: int
    input_source: list[str]
    layers: list[LayerProfile] = field(default_factory=list)

    @property
    def total_macs(self) -> int:
        return sum(la.macs for la in self.layers)

    @property
    def gops(self) -> float:
        """Giga operations (2 per MAC) of one run on the example batch."""
        return 2 * self.total_macs / 1e9

    #: distinct parameter bytes (a constant shared by layers counts once here, per layer in the rows)
    param_bytes: int = 0

    @property
    def bytes_moved(self) -> int:
        return sum(la.bytes_moved for la in self.layers)

    @property
    def est_time_s(self) -> float:
        """BPU and CPU time added: the float part waits for the BPU's results (and feeds it)."""
        return sum(la.est_time_s for la in self.layers)

    @property
    def est_bpu_time_s(self) -> float:
        return sum(la.est_time_s for la in self.layers if la.unit == "BPU")

    @property
    def est_cpu_time_s(self) -> float:
        return sum(la.est_time_s for la in self.layers if la.unit == "CPU")

    @property
    def est_fps(self) -> float:
        """Estimated images per second: the example batch over the estimated time."""
        t = self.est_time_s
        return self.batch / t if t > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {
            "note": ESTIMATE_NOTE,
            "model": self.model,
            "march": self.roofline.march,
            "device": self.roofline.device,
            "opt": self.opt,
            "input_source": self.input_source,
            "batch": self.batch,
            "roofline": {
                "peak_int8_macs_per_s": self.roofline.peak_int8_macs_per_s,
                "dram_bytes_per_s": self.roofline.dram_bytes_per_s,
                "int16_mac_cost": self.roofline.int16_mac_cost,
                "sources": list(self.roofline.sources),
                "cpu_device": self.roofline.cpu_device,
                "cpu_float_ops_per_s": self.roofline.cpu_float_ops_per_s,
                "cpu_sources": list(self.roofline.cpu_sources),
            },
            "totals": {
                "macs": self.total_macs,
                "gops": self.gops,
                "param_bytes": self.param_bytes,
                "params_mb": self.param_bytes / 1e6,
                "bytes_moved": self.bytes_moved,
                "est_time_s": self.est_time_s,
                "est_bpu_time_s": self.est_bpu_time_s,
                "est_cpu_time_s": self.est_cpu_time_s,
                "float_ops": sum(la.float_ops for la in self.layers),
                "est_fps": self.est_fps,
                "layers": len(self.layers),
            },
            "layers": [{**asdict(la), "bytes_moved": la.bytes_moved} for la in self.layers],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def text(self, layer_details: bool = True) -> str:
        r = self.roofline
        lines = [
            f"qir perf_model: {self.model} on {r.describe()}",
            f"  {ESTIMATE_NOTE}.",
            f"  opt={self.opt}  input_source={','.join(self.input_source)}  batch={self.batch}",
            "  roofline basis:",
        ]
        lines += [f"    - {s}" for s in [*r.sources, *r.cpu_sources]]
        if layer_details:
            head = [
                "layer",
                "module",
                "unit",
                "kernels",
                "output",
                "dtype",
                "MACs",
                "in B",
                "out B",
                "param B",
                "est. us",
                "bound",
            ]
            rows = [
                [
                    la.name,
                    la.module,
                    la.unit,
                    "+".join(la.kernels),
                    _shapes_text(la),
                    la.output_dtype,
                    f"{la.macs:,}",
                    f"{la.input_bytes:,}",
                    f"{la.output_bytes:,}",
                    f"{la.param_bytes:,}",
                    f"{la.est_time_s * 1e6:.3f}",
                    la.bound,
                ]
                for la in self.layers
            ]
            widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
            lines.append("")
            lines.append("  layers (estimated times):")
            for row in [head, *rows]:
                lines.append(
                    "  "
                    + "  ".join(
                        c.rjust(w) if i >= 6 and i < 11 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))
                    ).rstrip()
                )
        lines += [
            "",
            "  totals:",
            f"    layers          {len(self.layers)}",
            f"    MACs            {self.total_macs:,}  ({self.gops:.4f} GOPs, 2 ops per MAC)",
            f"    parameters      {self.param_bytes:,} B  ({self.param_bytes / 1e6:.4f} MB)",
            f"    bytes moved     {self.bytes_moved:,} B",
            f"    est. time       {self.est_time_s * 1e3:.4f} ms  (ESTIMATE: BPU {self.est_bpu_time_s * 1e3:.4f} ms "
            f"+ CPU float part {self.est_cpu_time_s * 1e3:.4f} ms in {sum(la.unit == 'CPU' for la in self.layers)} "
            "layer(s))",
            f"    est. FPS        {self.est_fps:,.1f}  (ESTIMATE, batch {self.batch})",
        ]
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.text(layer_details=True)


def _shapes_text(la: LayerProfile) -> str:
    """The output column: ``2x8x4x4``, a tuple's shapes comma-separated, ``-`` for none."""
    shapes = la.output_shapes if la.output_shapes is not None else [la.output_shape or []]
    return ",".join("x".join(map(str, s)) or "-" for s in shapes) or "-"


# ----------------------------------------------------------------------------- counting


def _macs(inst: Instruction, infos: Mapping[str, ValueInfo], consts: Mapping[str, torch.Tensor]) -> int:
    out = infos.get(inst.outputs[0]) if inst.outputs else None
    if out is None:
        return 0
    out_numel = _numel(out.shape)
    if inst.op in ("conv2d", "conv_nd", "linear"):
        w = consts[inst.consts["weight"]]
        if inst.op == "linear":
            return out_numel * int(w.shape[1])
        per = _numel(tuple(w.shape[1:]))
        if inst.attrs.get("kind") == "conv_transpose2d":
            return _numel(infos[inst.inputs[0]].shape) * per
        return out_numel * per
    if inst.op == "matmul" and len(inst.inputs) == 2:
        return out_numel * int(infos[inst.inputs[0]].shape[-1])
    if inst.op == "float_fn" and str(inst.attrs.get("fn")) in _FLOAT_LAYERS:
        return _float_layer_macs(inst, infos, out_numel)
    return 0


def _float_layer_macs(inst: Instruction, infos: Mapping[str, ValueInfo], out_numel: int) -> int:
    """MACs of a float conv / linear of the CPU part (a hybrid model's CPU layer), from its weight's shape."""
    fn = str(inst.attrs.get("fn"))
    args = list(inst.attrs.get("args", []))
    refs = [a.name if isinstance(a, ValueRef) else None for a in args[:2]]
    if len(refs) < 2 or refs[0] not in infos or refs[1] not in infos:
        return 0
    w = infos[refs[1]].shape  # type: ignore[index]
    if fn == "F.linear":
        return out_numel * int(w[1])
    per = _numel(tuple(w[1:]))
    if fn.startswith("F.conv_transpose"):
        return _numel(infos[refs[0]].shape) * per  # type: ignore[index]
    return out_numel * per


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _on_cpu(insts: Sequence[Instruction], infos: Mapping[str, ValueInfo]) -> bool:
    """The layer is the program's CPU float part: no quantize / dequantize, only float-part tensors."""
    if any(i.op in _BOUNDARY for i in insts):
        return False
    touched = [t for i in insts for v in [*i.inputs, *i.outputs] if v in infos for t in infos[v].leaves()]
    return all(t.dtype in _FLOAT_PART for t in touched) and (bool(touched) or any(i.op == "float_fn" for i in insts))


def _float_ops(inst: Instruction, infos: Mapping[str, ValueInfo]) -> int:
    """Float operations of one CPU step: one per element of its largest tensor, sorts n*ceil(log2 n) a row."""
    shapes = [t.shape for v in [*inst.inputs, *inst.outputs] if v in infos for t in infos[v].leaves()]
    if not shapes:
        return 0
    largest = max(shapes, key=_numel)
    n = _numel(largest)
    if inst.op == "constant" or (inst.op == "float_fn" and str(inst.attrs.get("fn")) in _FLOAT_LAYERS):
        return 0  # a stored parameter (its bytes count); a float layer's MACs count (two operations each)
    fn = str(inst.attrs.get("fn", "")).rsplit(".", 1)[-1] if inst.op == "float_fn" else ""
    if fn in _SORTS and largest:
        dim = _sort_dim(inst)
        row = int(largest[dim]) if -len(largest) <= dim < len(largest) else int(largest[-1])
        return n * max(1, math.ceil(math.log2(row))) if row > 1 else n
    return n


def _sort_dim(inst: Instruction) -> int:
    """The dimension a sort / argsort / topk runs along (torch's default: the last)."""
    fn = str(inst.attrs.get("fn", "")).rsplit(".", 1)[-1]
    args, kwargs = list(inst.attrs.get("args", [])), dict(inst.attrs.get("kwargs", {}))
    if "dim" in kwargs and isinstance(kwargs["dim"], int):
        return int(kwargs["dim"])
    pos = 2 if fn == "topk" else 1  # topk(x, k, dim), sort(x, dim)
    if len(args) > pos and isinstance(args[pos], int) and not isinstance(args[pos], bool):
        return int(args[pos])
    return -1


def _moves_nothing(inst: Instruction, infos: Mapping[str, ValueInfo]) -> bool:
    """A view, or picking one item of a tuple (whose producer counted every item's bytes)."""
    if inst.op != "shape_fn":
        return False
    fn = str(inst.attrs.get("fn"))
    if fn in VIEW_FNS:
        return True
    if fn != "getitem" or not inst.attrs.get("args"):
        return False
    seq = inst.attrs["args"][0]
    if isinstance(seq, (list, tuple)):
        return True  # an item of a Python tuple of values (a cell's (h, c))
    return isinstance(seq, ValueRef) and seq.name in infos and infos[seq.name].dtype == TUPLE


def _wide(inst: Instruction, infos: Mapping[str, ValueInfo], consts: Mapping[str, torch.Tensor]) -> bool:
    """An int16 operand (activation or weight): MACs cost ``int16_mac_cost`` int8 slots."""
    if any(t.dtype == "qint16" for v in inst.inputs if v in infos for t in infos[v].leaves()):
        return True
    w = inst.consts.get("weight")
    return w is not None and consts[w].dtype == torch.int16


def profile_program(
    program: Program,
    infos: Mapping[str, ValueInfo],
    roofline: Roofline,
    *,
    model: str = "",
    modules: Mapping[str, str] | None = None,
    input_source: Sequence[str] | None = None,
    opt: int = 2,
) -> ProgramProfile:
    """Profile ``program`` (``infos`` from :func:`value_infos`). ``modules``: layer name -> module name.

    ``input_source`` per program input: ``ddr`` reads the float input from DRAM (4 bytes an
    element); ``pyramid`` / ``resizer`` get 8-bit pixels from the image pipeline (1 byte).
    """
    sources = list(input_source or ["ddr"] * len(program.inputs))
    pixel_inputs = {name for name, s in zip(program.inputs, sources, strict=False) if s in ("pyramid", "resizer")}
    consts = program.constants
    order: list[str] = []
    groups: dict[str, list[Instruction]] = {}
    for inst in program.instructions:
        if inst.source not in groups:
            order.append(inst.source)
            groups[inst.source] = []
        groups[inst.source].append(inst)
    readers: dict[str, set[str]] = {}
    for inst in program.instructions:
        for v in inst.inputs:
            readers.setdefault(v, set()).add(inst.source)
    outputs = set(output_names(program.outputs))
    batch = infos[program.inputs[0]].shape[0] if program.inputs and infos[program.inputs[0]].shape else 1
    prof = ProgramProfile(
        model=model or str(program.meta.get("name", "")),
        roofline=roofline,
        batch=int(batch),
        opt=opt,
        input_source=sources,
    )
    seen_params: set[str] = set()
    distinct = 0
    for src in order:
        insts = groups[src]
        produced = {o for i in insts for o in i.outputs}
        macs = sum(_macs(i, infos, consts) for i in insts)
        weighted = sum(
            _macs(i, infos, consts) * (roofline.int16_mac_cost if _wide(i, infos, consts) else 1.0) for i in insts
        )
        moving = [i for i in insts if not _moves_nothing(i, infos)]
        in_vals = {v for i in moving for v in i.inputs if v not in produced and v in infos}
        in_bytes = sum(
            infos[v].nbytes // 4 if v in pixel_inputs and infos[v].dtype == "float32" else infos[v].nbytes
            for v in in_vals
        )
        out_vals = [
            o for i in moving for o in i.outputs if o in infos and (o in outputs or readers.get(o, set()) - {src})
        ]
        out_bytes = sum(infos[o].nbytes for o in out_vals)
        params = {c for i in insts for role, c in i.consts.items() if role in PARAM_ROLES}
        p_bytes = sum(consts[c].numel() * consts[c].element_size() for c in params)
        for c in params - seen_params:
            distinct += consts[c].numel() * consts[c].element_size()
        seen_params |= params
        last = insts[-1].outputs[0] if insts[-1].outputs else ""
        info = infos.get(last)
        cpu = _on_cpu(insts, infos)
        f_ops = sum(_float_ops(i, infos) for i in moving) + 2 * macs if cpu else 0
        if cpu:
            t, bound = estimate_cpu_seconds(roofline, f_ops, in_bytes + out_bytes + p_bytes)
        else:
            t, bound = estimate_seconds(roofline, weighted, in_bytes + out_bytes + p_bytes)
        prof.layers.append(
            LayerProfile(
                name=src,
                module=(modules or {}).get(src, src),
                kernels=[i.op for i in insts],
                macs=macs,
                weighted_macs=weighted,
                input_bytes=in_bytes,
                output_bytes=out_bytes,
                param_bytes=p_bytes,
                output_shape=list(info.shape) if info and not info.parts else None,
                output_dtype=(",".join(t.dtype for t in info.leaves()) if info.parts else info.dtype) if info else "-",
                est_time_s=t,
                bound=bound,
                unit="CPU" if cpu else "BPU",
                float_ops=f_ops,
                output_shapes=[list(t.shape) for t in info.leaves()] if info and info.parts else None,
            )
        )
    prof.param_bytes = distinct
    return prof
