"""``DeployableDigitsNet``: a digits CNN on the native 8x8 images, ready for the whole flow.

Unlike :class:`qir.examples.DigitsNet` (28x28, no stubs: a tracing / pass example), this
model carries its own QuantStub / DeQuantStub, so ``prepare_qat_fx`` -> ``convert_fx`` ->
``compile_model`` take it as it is, and uses only operators both marches run on the BPU:
conv + BN + ReLU, a residual add, max pool, AvgPool2d (kernel 4 <= Bernoulli2's 7) and a
1x1-conv classifier (Bernoulli2 has no Linear).

It works on 8x8 inputs rather than upsampled 28x28 ones: upsampling adds no information
to the 17-level pixels and makes every conv about 12x dearer, time the demo spends on
training epochs instead.
"""

from __future__ import annotations

import torch
from torch import nn

from qir.quantization.stubs import DeQuantStub, QuantStub

__all__ = ["DeployableDigitsNet"]


class DeployableDigitsNet(nn.Module):
    """(N, 1, 8, 8) pixels in [-0.5, 0.5] -> (N, 10) logits."""

    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        # Inputs are multiples of 1/32 in [-0.5, 0.5]: a fixed 1/128 scale quantizes them exactly.
        self.quant = QuantStub(scale=1 / 128)
        self.conv0 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(width)
        self.relu0 = nn.ReLU()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.add = torch.ao.nn.quantized.FloatFunctional()
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.relu2 = nn.ReLU()
        self.avg = nn.AvgPool2d(4)
        self.classifier = nn.Conv2d(2 * width, num_classes, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu0(self.bn0(self.conv0(self.quant(x))))
        x = self.relu1(self.add.add(self.bn1(self.conv1(x)), x))
        x = self.pool(x)
        x = self.avg(self.relu2(self.bn2(self.conv2(x))))
        return self.dequant(self.classifier(x)).flatten(1)
