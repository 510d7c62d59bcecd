"""One QAT module per call site of a module the forward calls at several places.

Users call one module at several places: one ``DeQuantStub`` for every output, one
``QuantStub`` for two inputs, one ``nn.ReLU`` twice, one conv head on every FPN level,
one ``FloatFunctional`` for several adds. Each call site sees its own value range, so one
output observer for all of them would quantize every site with the widest range, and a
quantized module has one fixed input scale. ``prepare_qat_fx`` therefore gives every call
site after the first its own QAT module, ``<path>_call<k>`` (``k`` = 1, 2, ... in the
order the forward makes the calls) beside the module, *tied* to the first:

- its parameters, its buffers outside fake quants and its weight fake quants are the
  first site's objects, held as plain attributes (not registered), so there is one weight,
  one weight fake quant, one optimizer entry and one state-dict key for each of them;
- its output fake quant (``activation_post_process``, and any other activation fake
  quant inside it) is its own, registered: state-dict keys
  ``<path>_call<k>.activation_post_process.*``.

The first call site keeps the module's path and keys, so a model whose modules are each
called once prepares exactly as before. Conversion then meets one QAT module per call site
and gives each its own input and output scales (docs/qconfig.md, "Modules called at
several places").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx
from torch import nn

from qir.quantization.fake_quantize import FakeQuantize

__all__ = ["SITE_SUFFIX", "call_sites", "retie", "retie_after_load", "site_path", "split_call_sites", "tie_to"]

#: clone paths are ``<path>_call<k>``
SITE_SUFFIX = "_call"


def _module_at(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def call_sites(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """Module path -> the nodes that call it, in graph order.

    A call is a ``call_module`` node, or a ``call_method`` node on a ``get_attr`` of a module
    (``self.add.add(a, b)`` on a FloatFunctional)."""
    sites: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            sites.setdefault(str(n.target), []).append(n)
        elif n.op == "call_method" and n.args and isinstance(n.args[0], torch.fx.Node):
            src = n.args[0]
            if src.op == "get_attr" and isinstance(_module_at(gm, str(src.target)), nn.Module):
                sites.setdefault(str(src.target), []).append(n)
    return sites


def site_path(path: str, k: int) -> str:
    """The path of call site ``k`` (1, 2, ...) of the module at ``path``."""
    return f"{path}{SITE_SUFFIX}{k}"


def split_call_sites(gm: torch.fx.GraphModule, paths: Iterable[str]) -> dict[str, list[str]]:
    """Point every call of each module in ``paths`` after the first at a new path (in place).

    Returns ``{path: [site paths]}`` for the modules called at several places. Only the
    graph changes: the caller puts a module at every new path, then recompiles ``gm``."""
    sites = call_sites(gm)
    out: dict[str, list[str]] = {}
    for path in paths:
        nodes = sites.get(path, [])
        if len(nodes) < 2:
            continue
        new_paths: list[str] = []
        for k, n in enumerate(nodes[1:], start=1):
            new = site_path(path, k)
            if _module_at(gm, new) is not None:
                raise ValueError(
                    f"module '{path}' is called at {len(nodes)} places and prepare gives each call after the "
                    f"first its own module at '{new}', but the model already has a module there; rename it"
                )
            if n.op == "call_module":
                n.target = new
            else:
                old = n.args[0]
                with gm.graph.inserting_before(n):
                    # create_node: the module at ``new`` is put there by the caller afterwards
                    getter = gm.graph.create_node("get_attr", new)
                n.args = (getter, *n.args[1:])
                if isinstance(old, torch.fx.Node) and not old.users:
                    gm.graph.erase_node(old)
            new_paths.append(new)
        out[path] = new_paths
    return out


#: plain attribute of a tied module: (the module it is tied to, the names it shares)
_TIE = "_qir_tied_to"


def tie_to(clone: nn.Module, owner: nn.Module) -> None:
    """Make ``clone`` (a QAT module built like ``owner``) use ``owner``'s weights (see module doc)."""
    if type(clone) is not type(owner):
        raise TypeError(f"cannot tie a {type(clone).__name__} to a {type(owner).__name__}")
    names: list[str] = []
    for name, p in list(clone._parameters.items()):
        if p is not None:
            del clone._parameters[name]
            names.append(name)
    for name, b in list(clone._buffers.items()):
        if b is not None:
            del clone._buffers[name]
            names.append(name)
    for name, child in list(clone._modules.items()):
        theirs = owner._modules.get(name)
        if child is None or theirs is None:
            continue
        if isinstance(child, FakeQuantize):
            if "weight" in name:  # weight_fake_quant, weight_ih_fake_quant, ...: shared
                del clone._modules[name]
                names.append(name)
            continue  # an activation fake quant: this call site's own
        tie_to(child, theirs)
    # Plain instance attributes win over nn.Module.__getattr__, so ``clone.weight`` is the
    # owner's Parameter while state_dict(), parameters() and children() skip it.
    object.__setattr__(clone, _TIE, (owner, tuple(names)))
    _refresh(clone)


def _refresh(clone: nn.Module) -> None:
    owner, names = clone.__dict__[_TIE]
    for name in names:
        object.__setattr__(clone, name, getattr(owner, name))


def retie(root: nn.Module) -> None:
    """Point every tied module of ``root`` at its owner's current tensors again.

    ``load_state_dict(..., assign=True)`` replaces the owner's Parameter objects; prepare
    registers this as a load_state_dict post-hook so the call sites keep sharing them."""
    for m in root.modules():
        if _TIE in m.__dict__:
            _refresh(m)


def retie_after_load(module: nn.Module, incompatible_keys: object) -> None:
    """``register_load_state_dict_post_hook`` form of :func:`retie`."""
    del incompatible_keys
    retie(module)
