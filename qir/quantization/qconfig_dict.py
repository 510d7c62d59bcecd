"""The ``qconfig_dict`` of ``prepare_qat_fx`` and how one module's qconfig is chosen.

Accepted keys (both spellings the seeds use)::

    {
        "": qconfig,                                       # global
        "module_type": {nn.Conv2d: qc} or [(nn.Conv2d, qc)],
        "module_name": {"layer1": qc} or [("conv1", qc)],  # a name covers its children
    }

Precedence for one module, most specific first: ``module_name`` (the longest matching
name; a fused module also answers to the names of the modules it absorbed), then
``module_type`` (the original class, or for generated FloatFunctionals the replaced
function, e.g. ``operator.add``), then a ``.qconfig`` attribute set on the module or a
non-root ancestor, then ``""``, then the root's ``.qconfig``. A value of ``None``
means "leave this module float".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qir.quantization.qconfig import QConfig, as_qir_qconfig

__all__ = ["QConfigSpec", "parse_hybrid_dict", "parse_qconfig_dict"]

_KEYS = ("", "module_type", "module_name")
_UNSET = object()


def _check_qconfig(value: Any, where: str) -> QConfig | None:
    return as_qir_qconfig(value, f"qconfig_dict{where}")


def _pairs(value: Any, key: str) -> list[tuple[Any, Any]]:
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        out = []
        for i, item in enumerate(value):
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise TypeError(f"qconfig_dict[{key!r}][{i}] must be a (key, qconfig) pair, got {item!r}")
            out.append((item[0], item[1]))
        return out
    raise TypeError(f"qconfig_dict[{key!r}] must be a dict or a list of pairs, got {type(value).__name__}")


def _prefixes(path: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "a.b", "a"]`` (most specific first)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


@dataclass
class QConfigSpec:
    """A parsed qconfig_dict plus the model's ``.qconfig`` attributes."""

    global_qconfig: Any = _UNSET
    module_type: list[tuple[Any, QConfig | None]] = field(default_factory=list)
    module_name: dict[str, QConfig | None] = field(default_factory=dict)
    attrs: dict[str, QConfig | None] = field(default_factory=dict)

    def resolve(self, path: str, names: Sequence[str] = (), types: Iterable[Any] = ()) -> QConfig | None:
        """The qconfig of the module at ``path`` (also known as ``names``, of classes ``types``)."""
        best: tuple[int, QConfig | None] | None = None
        for name in (path, *names):
            for p in _prefixes(name):
                if p in self.module_name:
                    depth = p.count(".") + 1
                    if best is None or depth > best[0]:
                        best = (depth, self.module_name[p])
                    break
        if best is not None:
            return best[1]
        type_list = list(types)
        for key, qc in self.module_type:
            if any(key is t or (isinstance(t, type) and isinstance(key, type) and t is key) for t in type_list):
                return qc
        for name in (path, *names):
            for p in _prefixes(name):
                if p in self.attrs:
                    return self.attrs[p]
        if self.global_qconfig is not _UNSET:
            return self.global_qconfig  # type: ignore[no-any-return]
        return self.attrs.get("")


def parse_qconfig_dict(qconfig_dict: Mapping[str, Any] | None, attrs: Mapping[str, Any] | None = None) -> QConfigSpec:
    """Validate ``qconfig_dict`` (None allowed) and merge in the ``.qconfig`` attributes."""
    spec = QConfigSpec(
        attrs={k: _check_qconfig(v, f" attribute {k or '<root>'}.qconfig") for k, v in (attrs or {}).items()}
    )
    if qconfig_dict is None:
        return spec
    if not isinstance(qconfig_dict, Mapping):
        raise TypeError(f"qconfig_dict must be a dict, got {type(qconfig_dict).__name__}")
    unknown = [k for k in qconfig_dict if k not in _KEYS]
    if unknown:
        raise KeyError(
            f"qconfig_dict has unknown keys {unknown}; valid keys: '' (global), 'module_type', 'module_name'"
        )
    if "" in qconfig_dict:
        spec.global_qconfig = _check_qconfig(qconfig_dict[""], "['']")
    for key, qc in _pairs(qconfig_dict.get("module_type", []), "module_type"):
        if not (isinstance(key, type) or callable(key)):
            raise TypeError(f"qconfig_dict['module_type'] keys must be module classes or functions, got {key!r}")
        spec.module_type.append((key, _check_qconfig(qc, f"['module_type'][{getattr(key, '__name__', key)}]")))
    for name, qc in _pairs(qconfig_dict.get("module_name", []), "module_name"):
        if not isinstance(name, str):
            raise TypeError(f"qconfig_dict['module_name'] keys must be module names (str), got {name!r}")
        spec.module_name[name] = _check_qconfig(qc, f"['module_name'][{name!r}]")
    return spec


def parse_hybrid_dict(hybrid_dict: Mapping[str, Any] | None) -> dict[str, list[Any]]:
    """Validate ``hybrid_dict`` (``{"module_name": [str...], "module_type": [class...]}``)."""
    if hybrid_dict is None:
        return {"module_name": [], "module_type": []}
    if not isinstance(hybrid_dict, Mapping):
        raise TypeError(f"hybrid_dict must be a dict, got {type(hybrid_dict).__name__}")
    unknown = [k for k in hybrid_dict if k not in ("module_name", "module_type")]
    if unknown:
        raise KeyError(f"hybrid_dict has unknown keys {unknown}; valid keys: 'module_name', 'module_type'")
    names = list(hybrid_dict.get("module_name", []))
    types = list(hybrid_dict.get("module_type", []))
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"hybrid_dict['module_name'] entries must be module names (str), got {n!r}")
    for t in types:
        if not isinstance(t, type):
            raise TypeError(f"hybrid_dict['module_type'] entries must be module classes, got {t!r}")
    return {"module_name": names, "module_type": types}
