"""A real compiled artifact and forged copies of it, for the hostile-artifact tests: the
``good`` and ``forge`` fixtures (tests/backends/conftest.py) and the helpers they use."""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bitexact_models import digits_net, fx_converted

from backends.common.artifact import MAGIC
from qir.quantization import compile_model


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], bytes]:
    """A real compiled model's header (decoded) and data section."""
    converted = fx_converted(digits_net(width=4), (4, 1, 28, 28), "bayes")
    path = tmp_path_factory.mktemp("hostile") / "digits.hbm"
    compile_model(converted, [torch.randn(2, 1, 28, 28)], hbm=path, opt=1)
    data = path.read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data, 0)
    start = 20 + hlen + (-(20 + hlen)) % 64
    return json.loads(data[20 : 20 + hlen]), data[start:-32]


def assemble(header: bytes, section: bytes) -> bytes:
    head = struct.pack("<8sIQ", MAGIC, 1, len(header)) + header
    body = head + b"\x00" * ((-len(head)) % 64) + section
    return body + hashlib.sha256(body).digest()


Forge = Callable[..., Path]


@pytest.fixture
def forge(good: tuple[dict[str, Any], bytes], tmp_path: Path) -> Forge:
    """``forge(edit)`` writes the good artifact with ``edit(header)`` applied (or ``header_text=``
    raw JSON, ``section=`` other data bytes), checksum fixed, and returns its path."""

    def make(
        edit: Callable[[dict[str, Any]], Any] | None = None,
        header_text: bytes | None = None,
        section: bytes | None = None,
    ) -> Path:
        header = copy.deepcopy(good[0])
        if edit is not None:
            edit(header)
        text = header_text if header_text is not None else json.dumps(header).encode()
        path = tmp_path / "forged.hbm"
        path.write_bytes(assemble(text, good[1] if section is None else section))
        return path

    return make


def instr(h: dict[str, Any], op: str) -> dict[str, Any]:
    """The first instruction of kernel ``op`` in header ``h``."""
    return next(d for d in h["program"]["instructions"] if d["op"] == op)
