"""``qir run ARTIFACT --input x.npy``: run a compiled artifact on the CPU; print / save its outputs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qir.cli.errors import UserError


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="run a compiled artifact on inputs from .npy / .npz files")
    p.add_argument("artifact", help="file written by qir compile / compile_model")
    p.add_argument(
        "--input",
        "-i",
        action="append",
        metavar="FILE",
        help=".npy per model input (repeat, in order), or one .npz holding them all",
    )
    p.add_argument("--output", "-o", metavar="FILE", help="save the outputs: .npy (one output) or .npz")
    p.add_argument("--threads", type=int, default=2, help="torch threads while running (default 2)")
    p.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="refuse an artifact that needs more memory at its compiled input shapes: bytes, or with a "
        "K / M / G suffix (powers of 1024), or 'none' for no bound (default 2G)",
    )
    p.set_defaults(run=run)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | None) -> int | None:
    """``--max-memory``: None (the default limit), 'none' (no bound), or a size like 512M / 4G."""
    from backends.common.artifact import DEFAULT_MAX_MEMORY

    if text is None:
        return DEFAULT_MAX_MEMORY
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t == "NONE":
        return None
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    digits = t[: len(t) - len(unit)]
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 15 or int(digits) < 1:
        raise UserError(
            f"--max-memory {text!r} is not a size: give a positive number of bytes of at most 15 digits, "
            "optionally with K, M, G or T (e.g. 4G), or 'none'"
        )
    return int(digits) * _UNITS[unit]


def _load_inputs(files: list[str]) -> list[np.ndarray]:
    arrays: list[np.ndarray] = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise UserError(f"--input '{p}' does not exist")
        try:
            loaded = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UserError(f"--input '{p}' cannot be read as a numpy .npy / .npz file: {e}") from None
        arrays += [loaded] if isinstance(loaded, np.ndarray) else [loaded[k] for k in loaded.files]
    return arrays


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    return [t for v in out for t in _flat(v)]


def _describe(i: int, t: torch.Tensor) -> list[str]:
    f = t.double()
    lines = [
        f"  output {i}: shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}  "
        f"min {f.min().item():.6g}  max {f.max().item():.6g}  mean {f.mean().item():.6g}"
    ]
    if t.dim() == 2 and t.shape[1] > 1:  # scores per class: the argmax is what users look for
        lines.append(f"    argmax per row: {t.argmax(1)[:16].tolist()}{' ...' if t.shape[0] > 16 else ''}")
    head = t.flatten()[:8].tolist()
    lines.append(f"    first values: {[round(v, 6) if isinstance(v, float) else v for v in head]}")
    return lines


def run(args: argparse.Namespace) -> int:
    from backends.common.artifact import ArtifactError
    from qir.quantization import load_compiled

    path = Path(args.artifact)
    if path.is_dir():
        raise UserError(f"artifact '{path}' is a directory, not a compiled model file")
    if not path.is_file():
        raise UserError(f"artifact '{path}' does not exist (make one with qir compile)")
    if args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    limit = parse_size(args.max_memory)
    try:
        compiled = load_compiled(path, num_threads=args.threads, max_memory=limit)
    except ArtifactError as e:
        raise UserError(str(e)) from None
    names = compiled.program.inputs
    if not args.input:
        raise UserError(f"artifact '{path}' takes {len(names)} input(s): give them with --input x.npy")
    arrays = _load_inputs(args.input)
    if len(arrays) != len(names):
        raise UserError(f"artifact '{path}' takes {len(names)} input(s), --input gave {len(arrays)} array(s)")
    for f, a in zip(args.input * len(arrays) if len(args.input) == 1 else args.input, arrays, strict=False):
        if a.dtype.kind not in "biuf":  # bool, ints, floats; not complex, strings or records
            raise UserError(f"--input '{f}' holds {a.dtype} values: give real numbers (float32 preferred)")
    inputs = [torch.from_numpy(np.ascontiguousarray(a)).float() for a in arrays]
    t0 = time.perf_counter()
    try:
        out = compiled(*inputs)
    except (RuntimeError, TypeError, ValueError) as e:  # InputError (a ValueError): the compiled shape
        shapes = ", ".join(str(tuple(a.shape)) for a in arrays)
        raise UserError(f"the artifact cannot run on input(s) of shape {shapes}: {str(e).splitlines()[0]}") from None
    secs = time.perf_counter() - t0
    outs = _flat(out)
    print(
        f"qir run: {path} (march {compiled.march}, {len(compiled.program.instructions)} kernel calls), "
        f"{secs * 1000:.1f} ms on {args.threads} thread(s)"
    )
    for i, t in enumerate(outs):
        print("\n".join(_describe(i, t)))
    if args.output:
        _save(Path(args.output), outs)
        print(f"  saved to {args.output}")
    return 0


def _save(p: Path, outs: list[torch.Tensor]) -> None:
    arrays = [t.numpy() for t in outs]
    try:
        if p.suffix == ".npy":
            if len(arrays) != 1:
                raise UserError(f"--output '{p}': the artifact has {len(arrays)} outputs; use a .npz file")
            np.save(p, arrays[0])
        elif p.suffix == ".npz":
            named: dict[str, Any] = {f"output{i}": a for i, a in enumerate(arrays)}
            np.savez(p, **named)
        else:
            raise UserError(f"--output '{p}': name it .npy (one output) or .npz")
    except OSError as e:
        raise UserError(f"cannot write --output '{p}': {e}") from None
