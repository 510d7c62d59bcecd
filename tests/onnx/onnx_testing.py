"""Shared pieces of the ONNX export tests: small models, an onnxruntime runner, graph readers."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from qir.quantization import FakeQuantize, MovingAveragePerChannelMinMaxObserver


def run_ort(f: str | os.PathLike[str] | bytes, *inputs: torch.Tensor) -> list[np.ndarray]:
    """Run with graph optimizations off: onnxruntime would otherwise fuse Q/DQ around a conv into
    integer kernels with their own requantization, which is not what the graph states."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(f if isinstance(f, bytes) else os.fspath(f), so, providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().numpy() for i, t in zip(sess.get_inputs(), inputs, strict=True)}
    return [np.asarray(o) for o in sess.run(None, feeds)]


def load(path: str | os.PathLike[str]) -> Any:
    import onnx

    return onnx.load(os.fspath(path))


def initializer(model: Any, name: str) -> np.ndarray:
    from onnx import numpy_helper

    for t in model.graph.initializer:
        if t.name == name:
            return np.asarray(numpy_helper.to_array(t))
    raise KeyError(name)


def quantize_nodes(model: Any) -> list[Any]:
    return [n for n in model.graph.node if n.op_type == "QuantizeLinear"]


def q_params(model: Any) -> list[tuple[np.ndarray, np.ndarray, int | None]]:
    """``(scale, zero_point, axis)`` of every QuantizeLinear, in graph order."""
    out = []
    for n in quantize_nodes(model):
        axis = next((a.i for a in n.attribute if a.name == "axis"), None)
        out.append((initializer(model, n.input[1]), initializer(model, n.input[2]), axis))
    return out


def ties(x: torch.Tensor, scale: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Where ``x / scale`` (float32, as both implementations compute it) is exactly ``k + 1/2``."""
    s = scale.reshape(()) if axis is None else scale.reshape([-1 if d == axis else 1 for d in range(x.dim())])
    v = x.float() / s
    return (v - torch.floor(v)) == 0.5


class HandQatConv(nn.Module):
    """A QAT conv built by hand from qir fake quants: input per tensor, weight per channel, and two
    outputs, fake-quantized to int8 and to int16.

    Scales are set so the comparison with onnxruntime is exact: the input and weight scales are
    powers of two and the bias sits on their product's grid, so every conv sum is exact in float32
    whatever the summation order; the output scales are not powers of two, and the test data has
    no tie at any fake quant (checked by the tests).
    """

    def __init__(self) -> None:
        super().__init__()
        self.input_fq = FakeQuantize()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.weight_fq = FakeQuantize(MovingAveragePerChannelMinMaxObserver, ch_axis=0)
        self.out8_fq = FakeQuantize(dtype="qint8")
        self.out16_fq = FakeQuantize(dtype="qint16")
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.conv.weight.copy_(torch.rand(self.conv.weight.shape, generator=gen) * 0.6 - 0.3)
            self.conv.bias.copy_(torch.round(torch.rand(4, generator=gen) * 2**12) * 2.0**-14)
        self.weight_fq.scale = torch.tensor([2.0**-8, 2.0**-7, 2.0**-9, 2.0**-8])
        self.weight_fq.zero_point = torch.zeros(4, dtype=torch.int32)
        self.input_fq.scale.fill_(2.0**-4)
        self.out8_fq.scale.fill_(0.0371)
        self.out16_fq.scale.fill_(0.0371 / 256)
        for fq in self.fake_quants():
            fq.disable_observer()

    def fake_quants(self) -> list[FakeQuantize]:
        """In graph order."""
        return [self.input_fq, self.weight_fq, self.out8_fq, self.out16_fq]

    def conv_out(self, x: torch.Tensor) -> torch.Tensor:
        """The float input of the output fake quants."""
        return torch.relu(
            nn.functional.conv2d(self.input_fq(x), self.weight_fq(self.conv.weight), self.conv.bias, padding=1)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv_out(x)
        return self.out8_fq(y), self.out16_fq(y)


def conv_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
