"""The compiled-model file: one versioned, checksummed file, no pickle, no code.

Byte layout (all integers little-endian)::

    offset  size  field
    0       8     magic  b"QIRPROG\\x00"
    8       4     format version (uint32)
    12      8     header length H (uint64)
    20      H     header: UTF-8 JSON {"program": ..., "tensors": [{name, dtype, shape, offset, nbytes}]}
    20+H    pad   zero bytes up to a multiple of 64
    D       ...   tensor data: raw little-endian arrays, each at ``D + offset`` (64-byte aligned)
    end-32  32    SHA-256 of every byte before it

Loading checks, in order: the file is long enough, the magic, the version (newer than
:data:`FORMAT_VERSION` is refused), the checksum, the header as strict JSON
(:mod:`backends.common.artifact_json`: no duplicate keys, no NaN / Infinity, bounded integer
literals and nesting), the tensor table (:mod:`backends.common.artifact_header`: known
dtypes, bounded shapes, byte sizes that match, byte ranges inside the data section and
disjoint), the program's fields (known march and kernels, names, constants that exist),
every scale finite and positive, then the wiring (:meth:`Program.validate`). Every failure
raises :class:`ArtifactError` naming the file, the header field and the rule; nothing is
allocated from a header value before its range is checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from backends.common.artifact_header import (
    HeaderError,
    TensorEntry,
    check_program_header,
    check_scales,
    check_tensor_table,
)
from backends.common.artifact_json import JSONLimitError, loads_strict
from backends.common.artifact_shapes import DEFAULT_MAX_MEMORY, infer_program
from backends.common.kernels.base import get_kernel, kernel_names
from backends.common.kernels.schema import SchemaError
from backends.common.program import CONST_DTYPES, Program, ProgramError
from passes.legality_registry import available_marches

__all__ = ["DEFAULT_MAX_MEMORY", "FORMAT_VERSION", "MAGIC", "ArtifactError", "read_program", "write_program"]

MAGIC = b"QIRPROG\x00"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
_DIGEST = 32
_ALIGN = 64
_NAMES = {v: k for k, v in CONST_DTYPES.items()}


class ArtifactError(ValueError):
    """A compiled-model file cannot be read: the message names the file and the problem."""


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def _raw(t: torch.Tensor) -> bytes:
    a = t.detach().contiguous().cpu()
    if sys.byteorder != "little" and a.element_size() > 1:
        raise ArtifactError("writing artifacts on a big-endian host is not supported")
    return a.view(torch.uint8).numpy().tobytes() if a.numel() else b""


def write_program(program: Program, path: str | os.PathLike[str]) -> Path:
    """Write ``program`` to ``path`` (atomically: a temporary file renamed into place). The program
    is checked against the same kernel schemas the loader applies, so qir never writes a file it
    would refuse to read."""
    program.validate()
    try:
        check_kernel_schemas(program)
        infer_program(program, max_memory=None)
    except HeaderError as e:
        raise ArtifactError(f"{path}: not written: {e.field}: {e.rule}") from None
    table: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    offset = 0
    for name, t in program.constants.items():
        raw = _raw(t)
        table.append(
            {"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape), "offset": offset, "nbytes": len(raw)}
        )
        blobs.append(raw + b"\x00" * _pad(len(raw)))
        offset += len(raw) + _pad(len(raw))
    header = json.dumps({"program": program.header(), "tensors": table}, separators=(",", ":"), allow_nan=False).encode(
        "utf-8"
    )
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    body = head + b"\x00" * _pad(len(head)) + b"".join(blobs)
    data = body + hashlib.sha256(body).digest()
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out


def read_program(path: str | os.PathLike[str], max_memory: int | None = DEFAULT_MAX_MEMORY) -> Program:
    """Read and verify a file written by :func:`write_program`. ``max_memory``: the most bytes the
    program may need at its declared input shapes (values alive at once plus kernel work space,
    found by shape inference); None: no bound (shapes are still inferred when the file declares
    its input shapes)."""
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory < 1):
        raise ValueError(f"max_memory must be a positive number of bytes or None, got {max_memory!r}")
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read the compiled model: {e.strerror or e}") from None
    if len(data) < _PREFIX.size + _DIGEST:
        raise ArtifactError(f"{p}: truncated: {len(data)} bytes is shorter than the fixed header and checksum")
    magic, version, hlen = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise ArtifactError(f"{p}: not a qir compiled model (magic {magic!r}, expected {MAGIC!r})")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{p}: format version {version} is newer than this qir reads ({FORMAT_VERSION}); "
            "upgrade qir or recompile the model"
        )
    if version < 1:
        raise ArtifactError(f"{p}: invalid format version {version}")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if _PREFIX.size + hlen > len(body):
        raise ArtifactError(f"{p}: truncated: the header claims {hlen} bytes, the file holds {len(body)} in all")
    if hashlib.sha256(body).digest() != digest:
        raise ArtifactError(f"{p}: checksum mismatch: the file is corrupted or truncated")
    try:
        header = loads_strict(body[_PREFIX.size : _PREFIX.size + hlen].decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{p}: header: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except JSONLimitError as e:
        raise ArtifactError(f"{p}: header: {e}") from None
    start = _PREFIX.size + hlen
    start += _pad(start)
    try:
        if not isinstance(header, dict):
            raise HeaderError("(top level)", "must be a JSON object with keys program and tensors")
        missing = sorted({"program", "tensors"} - set(header))
        extra = sorted(set(header) - {"program", "tensors"})
        if missing or extra:
            raise HeaderError(
                "(top level)", f"must have exactly the keys program and tensors (missing {missing}, unknown {extra})"
            )
        table = check_tensor_table(header["tensors"], max(0, len(body) - start))
        check_program_header(header["program"], available_marches(), kernel_names(), (t.name for t in table))
        constants = {t.name: _tensor(t, body, start) for t in table}
        check_scales(header["program"], constants)
    except HeaderError as e:
        raise ArtifactError(f"{p}: header field {e.field}: {e.rule}") from None
    try:
        prog = Program.from_header(header["program"], constants)
    except ProgramError as e:
        raise ArtifactError(f"{p}: invalid program: {e}") from None
    try:
        check_kernel_schemas(prog)
        infer_program(prog, max_memory)
    except HeaderError as e:
        raise ArtifactError(f"{p}: header field {e.field}: {e.rule}") from None
    return prog


def check_kernel_schemas(program: Program) -> None:
    """Every instruction against its kernel's declared schema (inputs, attributes, constants);
    :class:`HeaderError` naming ``program.instructions[i].<field>``."""
    for i, inst in enumerate(program.instructions):
        try:
            get_kernel(inst.op).schema.check(inst, program.constants)
        except SchemaError as e:
            raise HeaderError(
                f"program.instructions[{i}].{e.field}", f"{e.rule} ({inst.op} for '{inst.source}')"
            ) from None


def _tensor(t: TensorEntry, body: bytes, start: int) -> torch.Tensor:
    dtype = CONST_DTYPES[t.dtype]
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dtype)
    raw = bytearray(body[start + t.offset : start + t.offset + t.nbytes])
    return torch.frombuffer(raw, dtype=dtype).reshape(t.shape)
