"""The artifact file: round trip, and clear errors for truncated / corrupted / newer / foreign files."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from bitexact_models import digits_net, fx_converted

import qir
from backends.common.artifact import FORMAT_VERSION, MAGIC, ArtifactError, read_program
from backends.common.runtime import InputError
from qir.quantization import compile_model


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    converted = fx_converted(digits_net(width=4), (4, 1, 28, 28), "bayes")
    path = tmp_path_factory.mktemp("art") / "digits.hbm"
    compile_model(converted, [torch.randn(2, 1, 28, 28)], hbm=path, opt=1)
    return path, converted


def _rewrite(src: Path, dst: Path, data: bytes, fix_digest: bool = False) -> Path:
    if fix_digest:
        data = data[:-32] + hashlib.sha256(data[:-32]).digest()
    dst.write_bytes(data)
    return dst


def test_round_trip(artifact: tuple[Path, torch.nn.Module]) -> None:
    path, converted = artifact
    prog = read_program(path)
    assert prog.march == "bayes"
    assert path.read_bytes()[:8] == MAGIC
    run = qir.load_compiled(path)
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(run(x), converted(x))
    assert run.input_scales and all(s > 0 for s in run.input_scales.values())


def test_layout_is_aligned_and_checksummed(artifact: tuple[Path, torch.nn.Module]) -> None:
    data = artifact[0].read_bytes()
    magic, version, hlen = struct.unpack_from("<8sIQ", data, 0)
    assert (magic, version) == (MAGIC, FORMAT_VERSION)
    assert hashlib.sha256(data[:-32]).digest() == data[-32:]
    assert b"pickle" not in data[: 20 + hlen] and data[20:21] == b"{"


@pytest.mark.parametrize("cut", [0, 10, 40, -33, -1])
def test_truncated(artifact: tuple[Path, torch.nn.Module], tmp_path: Path, cut: int) -> None:
    data = artifact[0].read_bytes()
    bad = _rewrite(artifact[0], tmp_path / "t.hbm", data[:cut])
    with pytest.raises(ArtifactError, match=r"t\.hbm.*(truncated|checksum)"):
        qir.load_compiled(bad)


@pytest.mark.parametrize("where", ["header", "data", "digest"])
def test_corrupted_byte(artifact: tuple[Path, torch.nn.Module], tmp_path: Path, where: str) -> None:
    data = bytearray(artifact[0].read_bytes())
    pos = {"header": 30, "data": len(data) - 100, "digest": len(data) - 5}[where]
    data[pos] ^= 0x40
    bad = _rewrite(artifact[0], tmp_path / "c.hbm", bytes(data))
    with pytest.raises(ArtifactError, match=r"c\.hbm: checksum mismatch"):
        qir.load_compiled(bad)


def test_newer_version(artifact: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    data = bytearray(artifact[0].read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    bad = _rewrite(artifact[0], tmp_path / "v.hbm", bytes(data), fix_digest=True)
    with pytest.raises(ArtifactError, match=rf"v\.hbm: format version {FORMAT_VERSION + 1} is newer"):
        qir.load_compiled(bad)


def test_wrong_magic(artifact: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    data = b"PK\x03\x04" + artifact[0].read_bytes()[4:]
    bad = _rewrite(artifact[0], tmp_path / "m.hbm", data, fix_digest=True)
    with pytest.raises(ArtifactError, match=r"m\.hbm: not a qir compiled model"):
        qir.load_compiled(bad)


def _with_header(data: bytes, header: bytes) -> bytes:
    """``data`` re-assembled around a new header (data section re-aligned, checksum not yet fixed)."""
    _, version, hlen = struct.unpack_from("<8sIQ", data, 0)
    old_start = 20 + hlen + (-(20 + hlen)) % 64
    head = struct.pack("<8sIQ", MAGIC, version, len(header)) + header
    return head + b"\x00" * ((-len(head)) % 64) + data[old_start:]


def test_bad_header_and_tensor_table(artifact: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    data = artifact[0].read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data, 0)
    header = json.loads(data[20 : 20 + hlen])
    header["tensors"][0]["offset"] = 10**9  # a byte range outside the data section
    forged = _with_header(data, json.dumps(header).encode())
    bad = _rewrite(artifact[0], tmp_path / "h.hbm", forged, fix_digest=True)
    with pytest.raises(ArtifactError, match=r"h\.hbm: header field tensors\[0\]\.offset: tensor .* does not fit"):
        qir.load_compiled(bad)
    header["tensors"][0]["dtype"] = "object"
    bad = _rewrite(artifact[0], tmp_path / "d.hbm", _with_header(data, json.dumps(header).encode()), fix_digest=True)
    with pytest.raises(ArtifactError, match=r"d\.hbm: header field tensors\[0\]\.dtype: 'object' is not one of int8"):
        qir.load_compiled(bad)
    broken = _rewrite(artifact[0], tmp_path / "j.hbm", _with_header(data, b"{not json"), fix_digest=True)
    with pytest.raises(ArtifactError, match=r"j\.hbm: header: not valid JSON"):
        qir.load_compiled(broken)


def test_unknown_kernel_in_file_is_refused(artifact: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    data = artifact[0].read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data, 0)
    header = data[20 : 20 + hlen].replace(b'"op":"quantize"', b'"op":"os_system"', 1)
    bad = _rewrite(artifact[0], tmp_path / "k.hbm", _with_header(data, header), fix_digest=True)
    with pytest.raises(ArtifactError, match=r"k\.hbm: .*instructions\[0\]\.op: 'os_system' is not a kernel"):
        qir.load_compiled(bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"nope\.hbm: cannot read"):
        qir.load_compiled(tmp_path / "nope.hbm")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("exact_input_shapes", "yes", r"program\.meta\.exact_input_shapes: must be true or false"),
        ("specialized", "one line", r"program\.meta\.specialized: must be an array of strings"),
        ("specialized", ["ok", 3], r"program\.meta\.specialized\[1\]: must be a string"),
        # a list input's declared shapes: {"items": [shape, ...]}, checked like a tensor's
        ("input_shapes", [{"items": []}], r"input_shapes\[0\]\.items: has 0 shapes; 1 to 4096 are allowed"),
        ("input_shapes", [{"items": [[1]] * 4097}], r"input_shapes\[0\]\.items: has 4097 shapes"),
        ("input_shapes", [{"items": [[1, -2]]}], r"input_shapes\[0\]\.items\[0\]\[1\]"),
        ("input_shapes", [{"items": [[1] * 40]}], r"input_shapes\[0\]\.items\[0\]: rank 40 is over the limit"),
        ("input_shapes", [{"items": [[1]], "fn": "x"}], r"input_shapes\[0\]: unknown key\(s\) 'fn'"),
        ("input_shapes", [{"item": [[1]]}], r"input_shapes\[0\]: missing key\(s\) items"),
        ("input_shapes", ["2x2"], r"input_shapes\[0\]: must be an array of integers, null, or"),
    ],
)
def test_specialization_fields_are_validated(
    artifact: tuple[Path, torch.nn.Module], tmp_path: Path, field: str, value: object, message: str
) -> None:
    data = artifact[0].read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data, 0)
    header = json.loads(data[20 : 20 + hlen])
    header["program"]["meta"][field] = value
    bad = _rewrite(artifact[0], tmp_path / "s.hbm", _with_header(data, json.dumps(header).encode()), fix_digest=True)
    with pytest.raises(ArtifactError, match=message):
        qir.load_compiled(bad)


def test_exact_input_shapes_hold_the_batch(artifact: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    data = artifact[0].read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data, 0)
    header = json.loads(data[20 : 20 + hlen])
    header["program"]["meta"]["exact_input_shapes"] = True
    path = _rewrite(artifact[0], tmp_path / "e.hbm", _with_header(data, json.dumps(header).encode()), fix_digest=True)
    run, converted = qir.load_compiled(path), artifact[1]
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(run(x), converted(x))
    with pytest.raises(InputError, match=r"compiled for \[2, 1, 28, 28\] \(exactly"):
        run(torch.randn(3, 1, 28, 28))
