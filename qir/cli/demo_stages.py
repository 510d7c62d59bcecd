"""The stages of ``qir demo``, each timed, each adding one row to the final table."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from backends.common.perf import ProgramProfile
from qir.cli.demo_train import accuracy, batches, outputs, train
from qir.cli.tables import table

#: Name of the classifier layer, which QAT gives a high-precision (qint32) output.
CLASSIFIER = "classifier"


class Demo:
    """State carried from stage to stage, and the table rows."""

    def __init__(self, march: str, out: Path, seed: int, progress: bool | None, opt: int) -> None:
        self.march, self.out, self.seed, self.progress, self.opt = march, out, seed, progress, opt
        self.rows: list[list[str]] = []
        self.bit_exact: bool | None = None
        self.agreement = ""

    def _row(self, stage: str, acc: float | None, secs: float | None, result: str) -> None:
        self.rows.append([stage, "" if acc is None else f"{acc:.2f}%", "" if secs is None else f"{secs:.1f}", result])

    def run(self, epochs: int, qat_epochs: int) -> bool:
        """Every stage in order; True when the model is illegal on the march (stages after check skipped)."""
        from qir.examples import DeployableDigitsNet
        from qir.examples.digits_data import digits_split
        from qir.march import march_scope

        t0 = time.perf_counter()
        self.x_tr, self.y_tr, self.x_te, self.y_te = digits_split(seed=self.seed)
        self._row(
            "data",
            None,
            time.perf_counter() - t0,
            f"{len(self.y_tr)} train / {len(self.y_te)} test real 8x8 digits (fixed split)",
        )
        torch.manual_seed(self.seed)
        model = DeployableDigitsNet()
        self.float_stage(model, epochs)
        with march_scope(self.march):
            calib = self.calibrate_stage(model)
            qat = self.qat_stage(calib, qat_epochs)
            converted = self.convert_stage(qat)
            if not self.check_stage(converted):
                return True
            self.compile_stage(converted)
            self.perf_stage(converted)
            self.show_stage(converted)
        return False

    def _eval(self, model: nn.Module, desc: str) -> torch.Tensor:
        return outputs(model, self.x_te, desc, self.progress)

    def float_stage(self, model: nn.Module, epochs: int) -> None:
        from qir.frontend import trace
        from qir.ir.printer import print_graph

        t0 = time.perf_counter()
        train(
            model, self.x_tr, self.y_tr, epochs, lr=3e-3, seed=self.seed, desc="float training", progress=self.progress
        )
        acc = accuracy(self._eval(model, "float eval"), self.y_te)
        # The trained float model in the IR text form: something to try `qir opt -p absorb-bn,fuse` on.
        (self.out / "float.qir").write_text(print_graph(trace(model, (self.x_te[:1],))))
        self._row("float", acc, time.perf_counter() - t0, f"{_n(epochs, 'epoch')} (Adam, cosine lr); IR: float.qir")

    def calibrate_stage(self, model: nn.Module) -> nn.Module:
        from qir.quantization import get_default_calib_qconfig, prepare_qat_fx, set_fake_quantize

        t0 = time.perf_counter()
        calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
        set_fake_quantize(calib, "calibration")
        calib.eval()
        with torch.no_grad():
            outputs(calib, self.x_tr, "calibration", self.progress)
        set_fake_quantize(calib, "validation")  # evaluate with the calibrated scales, observers frozen
        acc = accuracy(self._eval(calib, "calibrated eval"), self.y_te)
        self._row(
            "calibrated",
            acc,
            time.perf_counter() - t0,
            f"calibration qconfig, {len(self.y_tr)} training images observed",
        )
        set_fake_quantize(calib, "calibration")
        return calib

    def qat_stage(self, calib: nn.Module, epochs: int) -> nn.Module:
        from qir.quantization import (
            get_default_qat_out_qconfig,
            get_default_qat_qconfig,
            prepare_qat_fx,
            set_fake_quantize,
        )

        t0 = time.perf_counter()
        qat = prepare_qat_fx(
            calib, {"": get_default_qat_qconfig(), "module_name": {CLASSIFIER: get_default_qat_out_qconfig()}}
        )
        train(qat, self.x_tr, self.y_tr, epochs, lr=1e-4, seed=self.seed + 1000, desc="QAT", progress=self.progress)
        # validation mode freezes the observers: evaluating in QAT mode would move the activation
        # scales with every test batch (test statistics leaking into the deployed scales)
        set_fake_quantize(qat, "validation")
        self.qat_logits = self._eval(qat, "QAT eval")
        self._row(
            "QAT",
            accuracy(self.qat_logits, self.y_te),
            time.perf_counter() - t0,
            f"{_n(epochs, 'epoch')} from the calibrated scales; {CLASSIFIER}: qint32 output; validation mode",
        )
        return qat

    def convert_stage(self, qat: nn.Module) -> nn.Module:
        from qir.quantization import convert_fx

        t0 = time.perf_counter()
        converted = convert_fx(qat)
        self.int_logits = self._eval(converted, "integer eval")
        agree = int((self.int_logits.argmax(1) == self.qat_logits.argmax(1)).sum())
        n = len(self.y_te)
        self.agreement = f"{100.0 * agree / n:.2f}% ({agree}/{n})"
        self._row(
            "integer (converted)",
            accuracy(self.int_logits, self.y_te),
            time.perf_counter() - t0,
            "convert_fx: integer kernels in torch",
        )
        self._row("QAT vs integer argmax", None, None, f"agree on {self.agreement}")
        return converted

    def check_stage(self, converted: nn.Module) -> bool:
        from qir.quantization import check_model

        t0 = time.perf_counter()
        report = check_model(converted, self.x_te[:1], march=self.march, advice=1)
        (self.out / "legality.txt").write_text(str(report) + "\n")
        verdict = "PASSED" if report.ok else f"FAILED ({len(report.violations)} errors)"
        self._row(
            "legality",
            None,
            time.perf_counter() - t0,
            f"{verdict} on {self.march}, {report.checked} nodes -> legality.txt",
        )
        return bool(report.ok)

    def compile_stage(self, converted: nn.Module) -> None:
        from qir.quantization import compile_model, load_compiled

        t0 = time.perf_counter()
        path = self.out / "digits.hbm"
        compile_model(
            converted,
            [self.x_te[:1]],
            hbm=path,
            march=self.march,
            opt=self.opt,
            check=False,
            name="DeployableDigitsNet",
        )
        self._row(
            "compile",
            None,
            time.perf_counter() - t0,
            f"compile_model opt {self.opt} -> digits.hbm ({path.stat().st_size / 1024:.1f} KiB)",
        )
        t0 = time.perf_counter()
        compiled = load_compiled(path)
        logits = outputs(compiled, self.x_te, "artifact eval", self.progress)
        self.bit_exact = logits.dtype == self.int_logits.dtype and torch.equal(logits, self.int_logits)
        self._row(
            "artifact (loaded)",
            accuracy(logits, self.y_te),
            time.perf_counter() - t0,
            f"qir.load_compiled('digits.hbm'), {len(compiled.program.instructions)} kernel calls",
        )
        n = len(self.y_te)
        self._row(
            "artifact == integer",
            None,
            None,
            f"{'yes' if self.bit_exact else 'NO'}: torch.equal on all {n} test logits",
        )

    def perf_stage(self, converted: nn.Module) -> None:
        from qir.quantization import perf_model

        t0 = time.perf_counter()
        prof = perf_model(
            converted,
            [self.x_te[:1]],
            out_dir=self.out,
            march=self.march,
            layer_details=True,
            name="DeployableDigitsNet",
            opt=self.opt,
        )
        self._row("perf", None, time.perf_counter() - t0, f"{_perf_summary(prof)} -> perf.txt, perf.json")

    def show_stage(self, converted: nn.Module) -> None:
        from qir.quantization import visualize_model

        t0 = time.perf_counter()
        path = visualize_model(converted, [self.x_te[:1]], save_path=self.out / "model.svg", march=self.march)
        self._row("visualize", None, time.perf_counter() - t0, f"-> {path.name}")

    def table(self, epochs: int, qat_epochs: int, total: float, threads: int) -> str:
        head = (
            f"qir demo: DeployableDigitsNet on real 8x8 digits, march {self.march}, {threads} torch thread(s), "
            f"output in {self.out}/"
        )
        rows = [["stage", "accuracy", "seconds", "result"], *self.rows, ["total", "", f"{total:.1f}", ""]]
        return head + "\n" + table(rows, right=(1, 2))


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def _perf_summary(prof: ProgramProfile) -> str:
    return f"{prof.total_macs:,} MACs, est. {prof.est_time_s * 1e3:.4f} ms/frame (roofline estimate)"


__all__ = ["Demo", "batches"]
