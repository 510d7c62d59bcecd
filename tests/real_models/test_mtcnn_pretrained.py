"""facenet-pytorch's pretrained MTCNN (PNet, RNet, ONet, weights from the wheel) on real photos:
calibrate on crops of sklearn's two sample images, QAT-prepare, convert, check, compile, and run
the artifact bit-exactly. RNet / ONet flatten with ``x.view(x.shape[0], -1)``, which could not be
compiled before (``.shape`` had no lowering rule). Figures: benchmarks/mtcnn_pretrained.py.

Runs only when selected: ``/work/tvenv/bin/python -m pytest -m torchvision tests/real_models/test_mtcnn_pretrained.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.torchvision
pytest.importorskip("facenet_pytorch")
pytest.importorskip("sklearn")


@pytest.mark.parametrize("name", ["pnet", "rnet", "onet"])
def test_mtcnn_pretrained_bayes(name: str, tmp_path: Path) -> None:
    from benchmarks.mtcnn_pretrained import run_one

    r = run_one(name, "bayes", calib=32, test=16, workdir=tmp_path)
    assert r["legal"] and r["bitexact"] is True, r
    # validation-mode QAT runs the integer twin: 0 measured (0.005-0.007 with float fake quant)
    assert r["qat_vs_int"] < 0.02, r
    assert r["face_agree"] >= 95.0, r


def test_mtcnn_pnet_bernoulli2_is_refused_by_name() -> None:
    """Bernoulli2 has no PReLU / Softmax: check_model says so (no compile, no silent fallback)."""
    from benchmarks.mtcnn_pretrained import run_one

    r = run_one("pnet", "bernoulli2", calib=16, test=8)
    assert not r["legal"] and {"prelu", "softmax"} <= set(r["illegal"]), r
