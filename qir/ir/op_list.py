"""The built-in IR ops as a markdown table, generated from the op registry (docs/ir-ops.md).

``python -m qir.ir.op_list > docs/ir-ops.md`` regenerates the page; a test checks it is current.
"""

from __future__ import annotations

import qir.ir  # noqa: F401  (registers the built-in ops)
from qir.ir.op import OP_REGISTRY, Op

HEADER = """# IR op names

Every built-in op of the IR, by the name the text form, `get_op_class`, patterns
(`P("conv2d")`, `("add", "conv2d")`) and `graphs(ops=...)` use. Generated from the op registry
by `python -m qir.ir.op_list > docs/ir-ops.md`; a test fails when it is out of date.

| op | class | traits | module classes | tensor methods |
|---|---|---|---|---|
"""


def _cell(items: list[str]) -> str:
    return ", ".join(f"`{x}`" for x in items) if items else ""


def _row(name: str, cls: type[Op]) -> str:
    module = cls.__module__.removeprefix("qir.ir.ops.")
    traits = sorted(t.__name__ for t in getattr(cls, "traits", ()))
    # integer ops get their module classes from the library that defines them (when imported)
    late = [] if getattr(cls, "state_roles", None) is None else ["integer modules of qir.nn.quantized"]
    late = [cls.registered_by] if isinstance(getattr(cls, "registered_by", None), str) else late  # type: ignore[attr-defined]
    modules = late or [m.__name__ for m in getattr(cls, "module_types", ())]
    methods = [m for m in getattr(cls, "methods", ()) if isinstance(m, str)]
    return f"| `{name}` | `{module}.{cls.__name__}` | {', '.join(traits)} | {_cell(modules)} | {_cell(methods)} |"


def op_list_markdown() -> str:
    """The page: one row per built-in op (classes defined in ``qir.ir.ops``), sorted by name."""
    rows = [_row(n, c) for n, c in sorted(OP_REGISTRY.items()) if c.__module__.startswith("qir.ir.ops.")]
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(op_list_markdown(), end="")
