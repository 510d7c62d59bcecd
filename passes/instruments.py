"""Pass instruments: objects the pass manager calls around each pass (as TVM's
``PassInstrument``): timing, IR printing and dumping, verification.

The manager calls, for instruments ``[a, b, c]``::

    a.run_before_pipeline ... c.run_before_pipeline
    for each pass:
        a.run_before_pass, b.run_before_pass, c.run_before_pass
        pass.apply
        c.run_after_pass, b.run_after_pass, a.run_after_pass      (reverse: hooks nest)
    c.run_after_pipeline ... a.run_after_pipeline

If a pass raises (or its result fails verification), ``run_after_pass_failed`` is called
(in reverse order) instead of the remaining ``run_after_pass`` hooks, then the manager
raises :class:`~passes.errors.PassFailure`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from passes.base import Pass, PassContext
from qir.ir.graph import Graph
from qir.ir.verifier import VerifyError, verify

if TYPE_CHECKING:
    from collections.abc import Collection

    from passes.manager import PipelineResult
    from passes.pipeline import Pipeline


class Instrument:
    """Base class with no-op hooks; override the ones you need.

    A hook may raise to stop the pipeline; only :class:`VerifyError` from
    ``run_after_pass`` is blamed on the pass (as a
    :class:`~passes.errors.PassVerificationFailure`), anything else propagates unchanged.
    """

    def run_before_pipeline(self, pipeline: Pipeline, graph: Graph, ctx: PassContext) -> None:
        """Before the first pass; ``graph`` is the graph the passes will mutate."""

    def run_before_pass(self, pass_: Pass, graph: Graph, ctx: PassContext) -> None:
        """Before ``pass_.apply(ctx, graph)``."""

    def run_after_pass(self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool) -> None:
        """After ``pass_`` returned ``changed``; ``ctx.history[-1]`` is its record (with timing)."""

    def run_after_pass_failed(self, pass_: Pass, graph: Graph, ctx: PassContext, error: BaseException) -> None:
        """After ``pass_`` raised ``error`` or left a graph that does not verify."""

    def run_after_pipeline(self, result: PipelineResult) -> None:
        """After the last pass, with the finished result (not called when a pass failed)."""


def graph_text(graph: Graph) -> str:
    """The IR text of ``graph`` (the printer's form; a node list if the printer is absent)."""
    try:
        from qir.ir.printer import print_graph
    except ImportError:
        # until qir.ir.printer exists: one node per line, enough to read a dump by eye
        lines = [f"graph @{graph.name}({', '.join(f'{a!r}: {a.type}' for a in graph.inputs)})"]
        lines += [f"  {n!r} : {n.type}" for n in graph.nodes]
        lines.append(f"  return {graph.output!r}")
        return "\n".join(lines) + "\n"
    text = print_graph(graph)
    return text if text.endswith("\n") else text + "\n"  # files and streams end lines


def _safe_text(graph: Graph) -> str:
    # a failed pass may leave a graph the printer cannot handle; still write what we can
    try:
        return graph_text(graph)
    except Exception as e:
        return f"// the graph could not be printed: {type(e).__name__}: {e}\n"


class VerifyInstrument(Instrument):
    """Verify the input graph once, then the graph after every pass (on by default).

    A failure after a pass is reported by the manager as a
    :class:`~passes.errors.PassVerificationFailure` naming that pass. ``verify_input=False``
    skips the input graph, for callers that just built it with the front end (every node
    typed by its op and checked when bound), where verifying it again finds nothing.
    """

    def __init__(self, check_types: bool = True, verify_input: bool = True) -> None:
        self.check_types = check_types
        self.verify_input = verify_input

    def run_before_pipeline(self, pipeline: Pipeline, graph: Graph, ctx: PassContext) -> None:
        if not self.verify_input:
            return
        try:
            verify(graph, self.check_types)
        except VerifyError as e:
            raise VerifyError(
                f"the input graph does not verify (before any pass ran): {e}; fix the graph or its front end", e.node
            ) from e

    def run_after_pass(self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool) -> None:
        verify(graph, self.check_types)


class TimingInstrument(Instrument):
    """Per-pass wall time across all runs it watches; ``report()`` prints a table.

    Times come from the manager's measurement of ``apply`` alone, so other instruments
    (verification, dumps) never count towards a pass.
    """

    def __init__(self) -> None:
        #: (pass text, seconds) for every pass run, in order.
        self.timings: list[tuple[str, float]] = []

    def run_after_pass(self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool) -> None:
        self.timings.append((str(pass_), ctx.history[-1].seconds))

    def reset(self) -> None:
        self.timings.clear()

    @property
    def total(self) -> float:
        return sum(t for _, t in self.timings)

    def report(self) -> str:
        """Seconds per pass (summed over runs), slowest first, with share of the total."""
        sums: dict[str, float] = {}
        runs: dict[str, int] = {}
        for name, t in self.timings:
            sums[name] = sums.get(name, 0.0) + t
            runs[name] = runs.get(name, 0) + 1
        total = self.total
        width = max([len("pass"), *(len(n) for n in sums)])
        lines = [f"{'pass':<{width}}  runs     seconds      %"]
        for name, t in sorted(sums.items(), key=lambda kv: -kv[1]):
            share = 100.0 * t / total if total > 0 else 0.0
            lines.append(f"{name:<{width}}  {runs[name]:>4}  {t:>10.6f}  {share:>5.1f}")
        lines.append(f"{'total':<{width}}  {len(self.timings):>4}  {total:>10.6f}  100.0")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


class DumpIRInstrument(Instrument):
    """Write the IR after each pass to ``directory/NN-<pass name>.qir`` (``00-absorb-bn.qir``).

    Numbers count passes within one run; a later run overwrites the files of an earlier
    one. When a pass fails, the graph as it was left goes to ``NN-<name>.failed.qir``.
    ``paths`` lists the files written by the last run.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.paths: list[Path] = []
        self._index = 0
        self._width = 2

    def run_before_pipeline(self, pipeline: Pipeline, graph: Graph, ctx: PassContext) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.paths = []
        self._index = 0
        self._width = max(2, len(str(len(pipeline) - 1)))

    def _path(self, pass_: Pass, suffix: str) -> Path:
        return self.directory / f"{self._index:0{self._width}d}-{pass_.name}{suffix}"

    def run_after_pass(self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool) -> None:
        path = self._path(pass_, ".qir")
        path.write_text(graph_text(graph))
        self.paths.append(path)
        self._index += 1

    def run_after_pass_failed(self, pass_: Pass, graph: Graph, ctx: PassContext, error: BaseException) -> None:
        path = self._path(pass_, ".failed.qir")
        path.write_text(_safe_text(graph))
        self.paths.append(path)
        self._index += 1


class PrintIRInstrument(Instrument):
    """Print the IR around passes to ``stream`` (default ``sys.stderr``).

    ``after_all`` / ``before_all`` choose when; ``only`` restricts to passes of those
    names; ``only_changed`` skips passes that reported no change.
    """

    def __init__(
        self,
        after_all: bool = True,
        before_all: bool = False,
        stream: TextIO | None = None,
        only: Collection[str] | None = None,
        only_changed: bool = False,
    ) -> None:
        self.after_all = after_all
        self.before_all = before_all
        self.stream = stream
        self.only = frozenset(only) if only is not None else None
        self.only_changed = only_changed

    def _wanted(self, pass_: Pass) -> bool:
        return self.only is None or pass_.name in self.only

    def _emit(self, title: str, graph: Graph) -> None:
        out = self.stream if self.stream is not None else sys.stderr  # resolved late: tests swap sys.stderr
        out.write(f"// ----- {title} -----\n{graph_text(graph)}")
        out.flush()

    def run_before_pass(self, pass_: Pass, graph: Graph, ctx: PassContext) -> None:
        if self.before_all and self._wanted(pass_):
            self._emit(f"IR before {pass_}", graph)

    def run_after_pass(self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool) -> None:
        if self.after_all and self._wanted(pass_) and (changed or not self.only_changed):
            self._emit(f"IR after {pass_}{'' if changed else ' (unchanged)'}", graph)
