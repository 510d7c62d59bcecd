"""Seed 002 (eager mode appendix) run with qir.

Changes from the seed: ``horizon_plugin_pytorch`` -> ``qir``; MNIST -> scikit-learn's digits
upsampled to 28x28 (no downloads); cuda -> cpu; files go to a temporary directory.
``check_model`` / ``compile_model`` / ``perf_model`` / ``visualize_model`` belong to a later
piece of work: :func:`test_seed_002_compile_tools` calls each one that exists and skips otherwise.
"""

# The seeds' code is kept as the seeds wrote it (only imports changed), old idioms included.
# ruff: noqa: UP004, UP008, UP031, UP032, B007, RUF059, E501, E721

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from digits_data import digits_tensors, loader


def _seed_002(tmp_path: Path) -> dict[str, Any]:
    import torch
    import torch.optim as optim
    from torch import nn
    from torch.quantization import DeQuantStub

    import qir as horizon
    from qir.quantization import QuantStub

    class ConvBNReLU(nn.Sequential):
        def __init__(self, in_channels, out_channels, kernel_size):
            super(ConvBNReLU, self).__init__(
                nn.Conv2d(in_channels=in_channels, out_channels=out_channels, kernel_size=kernel_size),
                nn.BatchNorm2d(num_features=out_channels),
                nn.ReLU(),
            )

        # Specify the floating point operators that can be fused
        def fuse_model(self):
            torch.quantization.fuse_modules(
                self,
                ["0", "1", "2"],
                inplace=True,
                fuser_func=horizon.quantization.fuse_known_modules,
            )

    class ClassiFier(nn.Module):
        def __init__(self, in_channels, out_channels):
            super(ClassiFier, self).__init__()
            self.conv = nn.Conv2d(in_channels, out_channels, 1)

        def forward(self, data):
            return self.conv(data)

    # Build the floating point model
    class Net(nn.Module):
        def __init__(self):
            super(Net, self).__init__()
            self.conv0 = ConvBNReLU(1, 10, 5)
            self.max_pool = nn.MaxPool2d(kernel_size=2)
            self.conv1 = ConvBNReLU(10, 20, 5)
            self.avg_pool = nn.AvgPool2d(kernel_size=8)
            self.classifier = ClassiFier(20, 10)
            # To adapt to the BPU, when getting input from the camera, the scale of the QuantStub must be set to 1/128 explicitly.
            self.quant = QuantStub(scale=1 / 128)
            self.dequant = DeQuantStub()

        def forward(self, x):
            # Insert quantization node to quantize the input
            x = self.quant(x)
            x = self.conv0(x)
            x = self.max_pool(x)
            x = self.conv1(x)
            x = self.avg_pool(x)
            x = self.classifier(x)
            # Insert dequantization node to dequantize the output
            x = self.dequant(x)
            return x

        # Define the fusion function
        def fuse_model(self):
            from qir import quantization  # noqa: F401

            for m in self.modules():
                if type(m) == ConvBNReLU:
                    m.fuse_model()

    train_batch_size = 16
    test_batch_size = 16
    epoch_num = 1
    neval_batches = 1
    model_file = str(tmp_path / "model.pt")

    class AverageMeter(object):
        """Computes and stores the average and current value"""

        def __init__(self, name, fmt=":f"):
            self.name = name
            self.fmt = fmt
            self.reset()

        def reset(self):
            self.val = 0
            self.avg = 0
            self.sum = 0
            self.count = 0

        def update(self, val, n=1):
            self.val = val
            self.sum += val * n
            self.count += n
            self.avg = self.sum / self.count

        def __str__(self):
            fmtstr = "{name} {val" + self.fmt + "} ({avg" + self.fmt + "})"
            return fmtstr.format(**self.__dict__)

    criterion = nn.CrossEntropyLoss()

    def accuracy(output, target, topk=(1,)):
        """Computes the accuracy over the k top predictions for the specified
        values of k
        """
        with torch.no_grad():
            maxk = max(topk)
            batch_size = target.size(0)

            _, pred = output.topk(maxk, 1, True, True)
            pred = pred.t()
            correct = pred.eq(target.view(1, -1).expand_as(pred))

            res = []
            for k in topk:
                correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
                res.append(correct_k.mul_(100.0 / batch_size))
            return res

    x_train, y_train, x_test, y_test = digits_tensors()
    x_train, y_train = x_train[:320], y_train[:320]  # a few batches (20) per epoch keep the test fast

    def get_train_data_loader():
        return loader(x_train, y_train, train_batch_size, shuffle=True)

    def get_test_data_loader():
        return loader(x_test, y_test, test_batch_size, shuffle=True)

    data_loader = get_train_data_loader()
    test_loader = get_test_data_loader()

    def train(model, device, optimizer, epoch):
        model.train()
        for batch_idx, (data, target) in enumerate(data_loader):
            data = data.to(device)
            target = target.to(device)
            output = model(data)
            output = output.view(-1, 10)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if batch_idx % 100 == 0:
                print("Train Epoch: {} batch {} \t Loss: {:.6f}".format(epoch, batch_idx, loss.item()))

    def evaluate(model, device, neval_batches):
        model.eval()
        top1 = AverageMeter("Acc@1", ":6.2f")
        top5 = AverageMeter("Acc@5", ":6.2f")
        tested_batches = 0
        with torch.no_grad():
            for batch_idx, (data, target) in enumerate(test_loader):
                tested_batches += 1
                data = data.to(device)
                target = target.to(device)
                output = model(data)
                output = output.view(-1, 10)
                loss = criterion(output, target)  # noqa: F841
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                top1.update(acc1[0], data.size(0))
                top5.update(acc5[0], data.size(0))
                if tested_batches >= neval_batches:
                    return top1, top5

        return top1, top5

    def train_float_model(device):
        model = Net().to(device)
        optimizer = optim.SGD(model.parameters(), lr=0.001, momentum=0.1)
        for nepoch in range(epoch_num):
            train(model, device, optimizer, nepoch)
            top1, top5 = evaluate(model, device, neval_batches)
            print(
                "float training Epoch %d :float evaluation accuracy on %d images, \
                %2.2f"
                % (nepoch, neval_batches * test_batch_size, top1.avg)
            )
        torch.save(model.state_dict(), model_file)

    train_float_model(torch.device("cpu"))

    def load_model():
        model = Net()
        state_dict = torch.load(model_file)
        model.load_state_dict(state_dict)
        model.to("cpu")
        return model

    # Load the float model for quantization-aware training
    qat_model = load_model()

    # Set march to BERNOULLI2 for **RDK X3** and BAYES for **RDK Ultra**.
    horizon.march.set_march(horizon.march.March.BAYES)

    qat_model.fuse_model()
    fused_printout = str(qat_model.conv0)

    def load_and_prepare_qat_model(device):
        # Load pre-trained floating-point model
        nonlocal qat_model
        qat_model = qat_model.to(device)
        top1, top5 = evaluate(qat_model, device, neval_batches)
        print(
            "float evaluation accuracy on %d images, \
            %2.2f"
            % (neval_batches * test_batch_size, top1.avg)
        )
        # Set the quantization parameters for quantizing the weights and outputs of operators
        qat_model.qconfig = horizon.quantization.get_default_qat_qconfig()
        # Turn off quantization for the output layer to improve accuracy
        qat_model.classifier.qconfig = horizon.quantization.get_default_qat_out_qconfig()
        # Convert the floating-point model to quantized model
        horizon.quantization.prepare_qat(qat_model, inplace=True)
        print(
            "After preparation for QAT, note fake-quantization modules \n",
            qat_model.conv0,
        )
        qat_model = qat_model.to(device)

    load_and_prepare_qat_model(torch.device("cpu"))

    def quantization_training(device):
        # Quantization training for the quantized model
        optimizer = optim.SGD(qat_model.parameters(), lr=0.0001)
        for nepoch in range(1):
            train(qat_model, device, optimizer, nepoch)
            # Evaluate the quantized model for one epoch
            top1, top5 = evaluate(qat_model, device, neval_batches)
            print(
                "QAT Epoch %d :float evaluation accuracy on %d images, %2.2f"
                % (nepoch, neval_batches * test_batch_size, top1.avg)
            )

    quantization_training(torch.device("cpu"))

    quantized_model = horizon.quantization.convert(qat_model.eval(), inplace=False)

    example_input = torch.ones(size=(neval_batches, 1, 28, 28), device="cpu")
    traced_model = torch.jit.trace(quantized_model, example_input)
    top1, top5 = evaluate(traced_model, torch.device("cpu"), neval_batches)
    print("Traced : int evaluation accuracy on %d images, %2.2f" % (neval_batches * test_batch_size, top1.avg))
    return {
        "qat_model": qat_model,
        "quantized_model": quantized_model,
        "traced": traced_model,
        "example_input": example_input,
        "fused_printout": fused_printout,
        "x_test": x_test,
    }


@pytest.fixture(scope="module")
def seed002(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from qir.march import get_march, set_march

    saved = get_march(None)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = _seed_002(tmp_path_factory.mktemp("seed002"))
    out["printed"] = buf.getvalue()
    yield out
    set_march(saved)


def test_seed_002_eager_flow(seed002: dict[str, Any]) -> None:
    from qir.nn import qat, quantized

    out = seed002
    assert out["fused_printout"] == (
        "ConvBNReLU(\n  (0): ConvReLU2d(\n    (0): Conv2d(1, 10, kernel_size=(5, 5), stride=(1, 1))\n"
        "    (1): ReLU()\n  )\n  (1): Identity()\n  (2): Identity()\n)"
    )
    assert isinstance(out["qat_model"].conv0[0], qat.ConvReLU2d)
    assert isinstance(out["quantized_model"].conv0[0], quantized.ConvReLU2d)
    printed = out["printed"]
    assert "Traced : int evaluation accuracy on 16 images" in printed
    x = out["x_test"][:64]
    with torch.no_grad():
        q = out["quantized_model"](x).view(-1, 10)
        t = out["traced"](x).view(-1, 10)
        f = out["qat_model"](x).view(-1, 10)
    assert torch.equal(q, t)
    assert (q.argmax(1) == f.argmax(1)).float().mean() >= 0.95


def test_seed_002_compile_tools(seed002: dict[str, Any], tmp_path: Path) -> None:
    import qir as horizon

    tools = [
        n for n in ("check_model", "compile_model", "perf_model", "visualize_model") if hasattr(horizon.quantization, n)
    ]
    if not tools:
        pytest.skip("check_model / compile_model / perf_model / visualize_model are not in qir yet")
    out = seed002
    quantized_model, traced_model, example_input = out["quantized_model"], out["traced"], out["example_input"]
    hbdk_dir = str(tmp_path / "hbdk_model")
    Path(hbdk_dir).mkdir()
    if "check_model" in tools:
        horizon.quantization.check_model(quantized_model, example_input, advice=1)
    if "compile_model" in tools:
        horizon.quantization.compile_model(traced_model, [example_input], opt=2, hbm=hbdk_dir + "/model.hbm")
    if "perf_model" in tools:
        horizon.quantization.perf_model(
            traced_model, [example_input], opt=2, input_source=["pyramid"], layer_details=True, out_dir=hbdk_dir
        )
    if "visualize_model" in tools:
        horizon.quantization.visualize_model(
            traced_model, [example_input], save_path=hbdk_dir + "/model.svg", show=False
        )
