"""Shape inference at load: operands that do not fit a kernel at the declared input shapes, and
the memory bound (``load_compiled(path, max_memory=...)``), refused before anything runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from artifact_forge import Forge
from artifact_forge import instr as _instr

import qir
from backends.common.artifact import DEFAULT_MAX_MEMORY, ArtifactError, read_program
from backends.common.artifact_shapes import infer_program
from backends.common.kernels.base import kernel_names, register_kernel
from backends.common.kernels.schema import KernelSchema
from qir.cli.cmd_run import parse_size
from qir.cli.errors import UserError


def _refused(path: Path, *words: str, max_memory: int | None = DEFAULT_MAX_MEMORY) -> str:
    with pytest.raises(ArtifactError) as info:
        qir.load_compiled(path, max_memory=max_memory)
    msg = str(info.value)
    assert msg.startswith(f"{path}: header field program."), msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_inferred_shapes_of_the_real_program(forge: Forge) -> None:
    prog = read_program(forge())
    values: dict[str, Any] = {}
    plan = infer_program(prog, None, values)
    assert plan is not None and plan.input_shapes == [[2, 1, 28, 28]]
    run = qir.load_compiled(forge())
    out = run(torch.randn(2, 1, 28, 28))
    final = values[prog.outputs]
    assert (final.shape, final.dtype) == (out.shape, out.dtype) == (torch.Size([2, 10]), torch.float32)
    assert 0 < plan.peak_bytes < 2**22


def test_forged_layout_sizes_are_refused_at_load(forge: Forge) -> None:
    """flatten -> reshape(x, 3, 7): 20 elements do not make 3 x 7 (ran, then failed, before)."""

    def edit(h: dict[str, Any]) -> None:
        d = _instr(h, "shape_fn")
        d["attrs"] = {"fn": "reshape", "args": [{"$v": d["inputs"][0]}, [3, 7]], "kwargs": {}}

    path = forge(edit)
    msg = _refused(path, "shape_fn for 'flatten'", "declared input shapes [[2, 1, 28, 28]]", "reshape", "invalid")
    assert "instructions[7]" in msg


def test_forged_dilation_that_leaves_no_output(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        _instr(h, "conv2d")["attrs"]["dilation"] = [4096, 4096]

    _refused(forge(edit), "instructions[1]", "conv2d for", "conv2d:")


def test_swapped_value_of_another_shape(forge: Forge) -> None:
    """The fused add's addend named as the stem's output (28 x 28 where the output is 14 x 14)."""

    def edit(h: dict[str, Any]) -> None:
        ins = h["program"]["instructions"]
        fused = next(d for d in ins if d["op"] == "conv2d" and d["attrs"]["has_add"])
        fused["inputs"][1] = ins[1]["outputs"][0]

    _refused(forge(edit), "instructions[3]", "the addend has shape [2, 4, 28, 28], the output [2, 4, 14, 14]")


def test_a_short_table_is_refused(forge: Forge) -> None:
    """The average pool divides windows of 49 by a table of one divisor: refused by its size."""

    def edit(h: dict[str, Any]) -> None:
        a = _instr(h, "avgpool2d")["attrs"]
        a["kernel_size"], a["stride"] = [1, 1], [1, 1]
        a["divisor_override"] = 50

    _refused(forge(edit), "average pool: window divisors range over [50, 50]", "covers [1, 49]")


def test_memory_above_the_limit_is_refused(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["program"]["meta"]["input_shapes"] = [[200_000, 1, 28, 28]]

    path = forge(edit)
    msg = _refused(
        path, "instructions[0]: quantize for", "the program needs", "over the limit of 2.0 GiB", "raise max_memory"
    )
    assert "[[200000, 1, 28, 28]]" in msg
    run = qir.load_compiled(path, max_memory=2**40)  # the user raises it: loads (and still runs at batch 2)
    assert run(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    qir.load_compiled(path, max_memory=None)
    # and the unforged file under a limit below its peak
    peak = infer_program(read_program(forge()), None)
    assert peak is not None
    _refused(forge(), f"({peak.peak_bytes} bytes) at the declared", max_memory=peak.peak_bytes - 1)
    qir.load_compiled(forge(), max_memory=peak.peak_bytes)


def test_an_input_larger_than_the_limit(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["program"]["meta"]["input_shapes"] = [[2**31 - 1] * 4]

    msg = _refused(forge(edit), "program.meta.input_shapes[0]", "a float32 input of shape", max_memory=None)
    assert "over the limit" in msg


def test_missing_input_shapes_need_max_memory_none(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        del h["program"]["meta"]["input_shapes"]

    path = forge(edit)
    _refused(path, "program.meta.input_shapes", "max_memory=None")
    assert qir.load_compiled(path, max_memory=None)(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2G"])
def test_max_memory_must_be_a_positive_int(forge: Forge, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_memory must be a positive number of bytes"):
        qir.load_compiled(forge(), max_memory=bad)


def test_too_many_pieces_are_refused_before_they_are_made(forge: Forge) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["program"]["meta"]["input_shapes"] = [[70_000, 1, 28, 28]]
        d = _instr(h, "shape_fn")
        d["attrs"] = {"fn": "split", "args": [{"$v": d["inputs"][0]}, 1], "kwargs": {}}

    _refused(forge(edit), "split would make 70000 tensors (limit 65536)", max_memory=None)


def test_every_kernel_declares_its_shapes() -> None:
    from backends.common.kernels.base import get_kernel

    assert all(get_kernel(op).schema.shape is not None for op in kernel_names())
    with pytest.raises(ValueError, match="declares no output shape"):
        register_kernel("no_shape_kernel", schema=KernelSchema())(lambda inst, args, state: [])
    assert "no_shape_kernel" not in kernel_names()


def test_cli_max_memory(forge: Forge, tmp_path: Path) -> None:
    assert parse_size(None) == DEFAULT_MAX_MEMORY
    assert parse_size("4G") == 4 * 2**30 and parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    assert parse_size("none") is None
    for bad in ("", "-1", "1e9", "0", "4X", "1" * 16):
        with pytest.raises(UserError, match="--max-memory"):
            parse_size(bad)


class _Mixed(torch.nn.Module):
    """Many kernels in one small model: depthwise and strided convs, a fused add, pools, a table,
    mul, cat, resize, softmax, layout functions and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        from torch.ao.quantization import DeQuantStub

        from qir.quantization import QuantStub

        nn = torch.nn
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.gate = nn.Sigmoid()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.gap = nn.AdaptiveAvgPool2d((2, 2))
        self.fc = nn.Linear(24 * 4, 6)
        self.soft = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(self.quant(x)))
        y = torch.relu(self.dw(y) + y)
        z = self.pool(self.down(y))
        z = self.avg(z) * self.gate(z)
        u = self.up(z)
        cat = torch.cat([u, self.down(y)[:, :8]], dim=1)
        g = self.gap(cat).permute(0, 2, 3, 1).reshape(x.shape[0], -1)
        return self.dequant(self.soft(self.fc(g)))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_declarations_agree_with_every_kernel_run(march: str) -> None:
    """Each instruction's inferred shape and dtype equal what its kernel computes."""
    from bitexact_models import fx_converted

    from backends.common.kernels.base import get_kernel
    from qir.quantization import compile_model

    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    program = compile_model(fx_converted(_Mixed(), tuple(x.shape), march), [x], opt=1, check=False).program
    values: dict[str, Any] = {}
    infer_program(program, None, values)

    def desc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.dtype)
        return [desc(e) for e in v] if isinstance(v, (list, tuple)) else v

    env: dict[str, Any] = {program.inputs[0]: x}
    ops = set()
    with torch.no_grad():
        for inst in program.instructions:
            kernel = get_kernel(inst.op)
            outs = kernel.run(inst, [env[v] for v in inst.inputs], kernel.prepare(inst, program.constants))
            for name, out in zip(inst.outputs, outs, strict=True):
                assert desc(values[name]) == desc(out), (inst.op, inst.source)
                env[name] = out
            ops.add(inst.op)
    want = {"conv2d", "maxpool2d", "avgpool2d", "adaptive_avgpool2d", "lut", "mul", "rescale", "resize_nearest"}
    assert want | {"softmax", "linear", "shape_fn", "quantize", "dequantize"} <= ops, ops
