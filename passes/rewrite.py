"""The rewrite driver: apply ``(name, pattern, rewriter)`` rules to a fixed point.

A rewriter receives the graph and a :class:`~passes.patterns.Match` and returns the
value that replaces the match's root, or None to decline (the driver then tries the
root's next binding, then the next rule). The driver replaces the root's uses, erases
matched nodes left without uses (and pure nodes, such as constants, that only they
used) and revisits what the change can affect: the replacement, its users up to the
deepest rule's depth, and the users of values that lost a use. Each node is visited a
bounded number of times, so a run costs time linear in the graph.

Rewriters must not erase nodes themselves; they may create nodes (insert them before
the root, which is after every matched value) and may return an existing node.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from passes.patterns import Match, Pattern, PatternLike, as_pattern, iter_matches
from qir.ir import Graph, IRError, Node, Op, Pure, Value
from qir.ir.ops.core import Constant

__all__ = [
    "FUSED_FROM",
    "FusedFrom",
    "RewriteError",
    "RewriteStats",
    "Rewriter",
    "Rule",
    "RuleLike",
    "RuleStats",
    "add_constant_after",
    "apply_rewrites",
    "as_rule",
    "constant_of",
    "free_constant_key",
    "fused_from",
    "like",
    "rebuild",
]

log = logging.getLogger("qir.rewrite")

Rewriter = Callable[[Graph, Match], Value | None]


class RewriteError(IRError):
    """The rule set did not converge, or a rewriter broke the driver's contract."""


@attrs.frozen
class Rule:
    """A named pattern and the function that rewrites its matches."""

    name: str
    pattern: Pattern = attrs.field(converter=as_pattern)
    rewrite: Rewriter


RuleLike = Rule | tuple[str, PatternLike, Rewriter]


def as_rule(rule: RuleLike) -> Rule:
    if isinstance(rule, Rule):
        return rule
    if not (isinstance(rule, tuple) and len(rule) == 3 and isinstance(rule[0], str) and callable(rule[2])):
        raise TypeError(f"a rule is Rule(...) or (name, pattern, rewriter), got {rule!r}")
    return Rule(rule[0], rule[1], rule[2])


@attrs.define
class RuleStats:
    """Per rule: roots tried (after the op-kind filter), matches found, rewrites applied."""

    tried: int = 0
    matched: int = 0
    applied: int = 0


@attrs.define
class RewriteStats:
    """What a run of :func:`apply_rewrites` did; rules that never fired show zeros."""

    rules: dict[str, RuleStats] = attrs.field(factory=dict)
    visited: int = 0
    erased: int = 0

    @property
    def applied(self) -> int:
        return sum(r.applied for r in self.rules.values())

    @property
    def changed(self) -> bool:
        return self.applied > 0

    def __str__(self) -> str:
        width = max([len(n) for n in self.rules] + [4])
        lines = [f"{'rule':<{width}}  {'tried':>7}  {'matched':>7}  {'applied':>7}"]
        for name, r in self.rules.items():
            lines.append(f"{name:<{width}}  {r.tried:>7}  {r.matched:>7}  {r.applied:>7}")
        lines.append(f"visited {self.visited} nodes, erased {self.erased}")
        return "\n".join(lines)


def apply_rewrites(graph: Graph, rules: Iterable[RuleLike], max_iterations: int | None = None) -> RewriteStats:
    """Rewrite ``graph`` in place until no rule applies; return per-rule statistics.

    Rules are tried in the given order at each node, nodes in graph order (then as the
    worklist brings them back). ``max_iterations`` bounds the number of applied
    rewrites (default ``8 * len(graph) + 64``); exceeding it raises
    :class:`RewriteError` naming the rules that kept firing.
    """
    rule_list = [as_rule(r) for r in rules]
    stats = RewriteStats({r.name: RuleStats() for r in rule_list})
    if len(stats.rules) != len(rule_list):
        raise ValueError(f"rule names must be unique: {[r.name for r in rule_list]}")
    limit = max_iterations if max_iterations is not None else 8 * len(graph) + 64
    depth = max((r.pattern.depth for r in rule_list), default=1)
    by_type: dict[type[Op], list[Rule]] = {}

    def rules_for(node: Node) -> list[Rule]:
        t = type(node.op)
        if t not in by_type:
            by_type[t] = [r for r in rule_list if r.pattern.accepts_kind(t)]
        return by_type[t]

    work: deque[Node] = deque(graph.nodes)
    queued: set[Node] = set(work)
    dead: set[Node] = set()

    def push_users(v: Value, levels: int) -> None:
        frontier: list[Value] = [v]
        for _ in range(levels):
            nxt: list[Value] = []
            for u in frontier:
                for user in u.users:
                    if user not in queued and user not in dead:
                        queued.add(user)
                        work.append(user)
                    nxt.append(user)
            frontier = nxt

    while work:
        node = work.popleft()
        queued.discard(node)
        if node in dead:
            continue
        stats.visited += 1
        for rule in rules_for(node):
            rs = stats.rules[rule.name]
            rs.tried += 1
            new: Value | None = None
            for m in iter_matches(rule.pattern, node):
                rs.matched += 1
                try:
                    new = rule.rewrite(graph, m)
                except Exception as e:  # name the rule: the traceback alone points into a user's rewriter
                    raise RewriteError(
                        f"rule {rule.name!r} failed rewriting %{node.name} ({node.op.name}) on @{graph.name}: "
                        f"{type(e).__name__}: {e}"
                    ) from e
                if new is not None:
                    break
            if new is None:
                continue
            if not isinstance(new, Value):
                raise RewriteError(
                    f"rule {rule.name!r} returned {new!r} for %{node.name}; a rewriter returns a Value or None"
                )
            rs.applied += 1
            log.debug("rule %s rewrote %%%s -> %%%s", rule.name, node.name, new.name)
            if stats.applied > limit:
                top = sorted(stats.rules.items(), key=lambda kv: -kv[1].applied)[:3]
                raise RewriteError(
                    f"rewrites on @{graph.name} did not converge after {limit} rewrites; most applied: "
                    + ", ".join(f"{n} ({r.applied}x)" for n, r in top)
                )
            if new is not node:
                if isinstance(new, Node) and new in dead:
                    raise RewriteError(f"rule {rule.name} returned the erased node %{new.name}")
                try:
                    node.replace_all_uses_with(new)
                except IRError as e:
                    raise RewriteError(f"rule {rule.name!r}: cannot replace %{node.name} with %{new.name}: {e}") from e
            touched = _erase_dead(graph, m.nodes, new, dead, stats)
            if isinstance(new, Node) and new not in queued:
                queued.add(new)
                work.append(new)
            push_users(new, depth)
            for v in touched:
                push_users(v, depth)
            break
    if stats.erased:
        graph.prune_constants()
    return stats


def _erase_dead(
    graph: Graph, matched: Sequence[Node], keep: Value, dead: set[Node], stats: RewriteStats
) -> list[Value]:
    """Erase unused matched nodes and the pure nodes only they used.

    Returns the surviving values that lost a use (their users may match now).
    """
    consumed = set(matched)
    stack: list[Node] = list(matched)
    touched: list[Value] = []
    while stack:
        n = stack.pop()
        if n in dead or n is keep or n.num_uses:
            continue
        if n not in consumed and not n.op.has_trait(Pure):
            continue
        operands = n.operands
        graph.erase_node(n)
        dead.add(n)
        stats.erased += 1
        for v in operands:
            if isinstance(v, Node) and v not in dead:
                stack.append(v)
            touched.append(v)
    return [v for v in touched if not (isinstance(v, Node) and v in dead)]


# --------------------------------------------------------------------------- helpers for rewriters


@attrs.frozen
class FusedFrom:
    """One original node folded into another (kept in ``node.meta["fused_from"]``).

    ``role`` is what it became (``"bn"``, ``"add"``, ``"act"``); ``op`` its op name;
    ``node`` / ``scope`` its value name and module path, so emitters can name fused
    modules; ``slot`` the operand index of the surviving node in it (which side of an
    add the conv was on).
    """

    role: str
    op: str
    node: str
    scope: str | None
    slot: int | None = None


FUSED_FROM = "fused_from"


def fused_from(node: Node) -> tuple[FusedFrom, ...]:
    """What was fused into ``node``, oldest first."""
    return tuple(node.meta.get(FUSED_FROM, ()))


def rebuild(
    graph: Graph,
    base: Node,
    op: Op,
    operands: Sequence[Value],
    *,
    before: Node,
    fused: Sequence[FusedFrom] = (),
) -> Node:
    """A node computing ``op(operands)``, inserted before ``before``, that takes over
    ``base``'s name, scope and meta (plus ``fused`` records); its type is ``before``'s.

    ``base`` is renamed out of the way and is left for the driver to erase.
    """
    name = base.name
    graph.rename(base, f"{name}_replaced")
    new = graph.create_node(op, operands, before.type, name, base.scope)
    new.meta = dict(base.meta)
    if fused:
        new.meta[FUSED_FROM] = (*fused_from(base), *fused)
    graph.insert_node(new, before=before)
    return new


def add_constant_after(
    graph: Graph,
    anchor: Node,
    key: str,
    tensor: torch.Tensor,
    kind: str = "parameter",
    scope: str | None = None,
) -> Node:
    """Register ``tensor`` under ``key`` with a ``constant`` node placed right after ``anchor``.

    Same result as :meth:`Graph.add_constant` but O(1): that method looks for the end of
    the constants block on every call, which makes per-layer folding quadratic.
    """
    if key in graph.constants:
        raise IRError(f"constant key {key!r} is already bound")
    graph.constants[key] = tensor
    op = Constant(key=key, kind=kind)
    node = graph.create_node(op, (), op.type_for(tensor), key, scope)
    graph.insert_node(node, after=anchor)
    return node


def free_constant_key(graph: Graph, key: str) -> str:
    """``key`` if unbound, else ``key_1``, ``key_2``, ..."""
    if key not in graph.constants:
        return key
    i = 1
    while f"{key}_{i}" in graph.constants:
        i += 1
    return f"{key}_{i}"


def constant_of(graph: Graph, v: Value) -> tuple[Node, torch.Tensor] | None:
    """``(node, tensor)`` when ``v`` is a ``constant`` node, else None."""
    if isinstance(v, Node) and isinstance(v.op, Constant):
        return v, graph.constants[v.op.key]
    return None


def like(old: torch.Tensor, new: torch.Tensor) -> Any:
    """``new`` in ``old``'s dtype, a Parameter (with the same requires_grad) if ``old`` was one."""
    t = new.detach().to(old.dtype)
    if isinstance(old, torch.nn.Parameter):
        return torch.nn.Parameter(t, requires_grad=old.requires_grad)
    return t
