"""The pass manager: run a pipeline over a graph, with instruments between passes.

    result = PassManager("absorb-bn,fuse,dce", instruments=[TimingInstrument()]).run(graph)
    result.graph        # the transformed graph (a copy; ``graph`` is untouched)
    result.changed      # per pass, in pipeline order
    result.stats        # counters the passes reported through ctx.count()

A pass that raises is reported as :class:`PassFailure` naming the pass, its options and
the passes that ran before it (like torch.fx's pass manager); a pass that leaves a graph
that does not verify is reported as :class:`PassVerificationFailure` naming it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import attrs

from passes.base import Pass, PassContext, PassRecord
from passes.constant_guard import ConstantGuard
from passes.errors import PassFailure, PassVerificationFailure
from passes.instruments import Instrument, VerifyInstrument
from passes.pipeline import Pipeline, as_pipeline, format_value, option_specs
from qir.ir.graph import Graph
from qir.ir.stand_ins import mark_derived, real_tensors
from qir.ir.verifier import VerifyError


@attrs.frozen
class PipelineResult:
    """What one :meth:`PassManager.run` produced."""

    graph: Graph
    pipeline: Pipeline
    #: One record per pass of this run, in order (``ctx.history`` may hold earlier runs too).
    records: tuple[PassRecord, ...]
    ctx: PassContext

    @property
    def changed(self) -> tuple[bool, ...]:
        """Whether each pass reported a change, in pipeline order."""
        return tuple(r.changed for r in self.records)

    @property
    def any_changed(self) -> bool:
        return any(self.changed)

    @property
    def timings(self) -> tuple[tuple[str, float], ...]:
        """(pass text, seconds in ``apply``) per pass, in pipeline order."""
        return tuple((str(r.pass_), r.seconds) for r in self.records)

    @property
    def stats(self) -> dict[str, int]:
        """Counters passes reported with ``ctx.count``."""
        return self.ctx.stats


def describe_options(p: Pass) -> str:
    """All options of ``p`` with their values, defaults included: ``max_iters=3, ops=[conv2d]``."""
    parts = []
    for o in option_specs(type(p)).values():
        value = getattr(p, o.attribute)
        try:
            text = format_value(o.type, value)
        except (TypeError, ValueError):
            text = repr(value)
        parts.append(f"{o.name}={text}")
    return ", ".join(parts) if parts else "none"


class PassManager:
    """Runs a pipeline of passes over graphs.

    ``pipeline`` is pipeline text (``"absorb-bn,fuse{...}"``), a :class:`Pipeline`, or
    pass instances. ``instruments`` are called around each pass (see
    :mod:`passes.instruments` for the order). With ``verify_each`` (default) a
    :class:`VerifyInstrument` is added last, so it checks each pass's result before any
    other instrument looks at it, unless ``instruments`` already holds one.
    """

    def __init__(
        self,
        pipeline: Pipeline | str | Pass | Iterable[Pass],
        instruments: Sequence[Instrument] | None = None,
        verify_each: bool = True,
    ) -> None:
        self.pipeline = as_pipeline(pipeline)
        insts = list(instruments or ())
        if verify_each and not any(isinstance(i, VerifyInstrument) for i in insts):
            insts.append(VerifyInstrument())
        self.instruments: tuple[Instrument, ...] = tuple(insts)
        self.verify_each = verify_each

    def __repr__(self) -> str:
        return f"PassManager({str(self.pipeline)!r})"

    def run(self, graph: Graph, inplace: bool = False, ctx: PassContext | None = None) -> PipelineResult:
        """Run every pass in order on a copy of ``graph`` (or on ``graph`` itself if ``inplace``).

        The copy shares constant tensors with ``graph`` (see :meth:`Graph.copy`): passes
        bind new tensors instead of writing into existing ones, so the input stays intact.
        """
        work = graph if inplace else graph.copy()
        # constants derived from zero stand-ins are stand-ins too (qir.ir.stand_ins): the input's real
        # tensors, taken once (the passes bind new tensors, the input's stay what they are)
        real = real_tensors(graph.constants)
        # the copy shares the input's constant tensors: check no pass writes into them
        guard = ConstantGuard(graph) if self.verify_each and not inplace else None
        ctx = ctx if ctx is not None else PassContext()
        first = len(ctx.history)
        for inst in self.instruments:
            inst.run_before_pipeline(self.pipeline, work, ctx)
        for index, p in enumerate(self.pipeline):
            self._run_pass(index, p, work, ctx, first, inplace, guard)
            if real is not None:  # before the next pass (a lowering) reads them
                mark_derived(real, work.constants)
        result = PipelineResult(work, self.pipeline, tuple(ctx.history[first:]), ctx)
        for inst in reversed(self.instruments):
            inst.run_after_pipeline(result)
        return result

    def _run_pass(
        self,
        index: int,
        p: Pass,
        graph: Graph,
        ctx: PassContext,
        first: int,
        inplace: bool,
        guard: ConstantGuard | None = None,
    ) -> None:
        for inst in self.instruments:
            inst.run_before_pass(p, graph, ctx)
        start = time.perf_counter()
        try:
            changed = p.apply(ctx, graph)
        except Exception as e:
            failure = self._failure(
                index, p, graph, ctx, first, inplace, f"raised {type(e).__name__}: {e}", guard=guard
            )
            self._notify_failed(reversed(self.instruments), p, graph, ctx, failure)
            raise failure from e
        seconds = time.perf_counter() - start
        if not isinstance(changed, bool):
            why = f"returned {changed!r} from apply(); apply() must return True (it changed the graph) or False"
            failure = self._failure(index, p, graph, ctx, first, inplace, why, guard=guard)
            self._notify_failed(reversed(self.instruments), p, graph, ctx, failure)
            raise failure
        edited = guard.edited() if guard is not None else []
        if edited:
            why = (
                f"wrote into constant tensor(s) {', '.join(edited)} in place; the pipeline's copy shares them "
                "with the input graph, so bind a new tensor (graph.add_constant) instead of editing one"
            )
            failure = self._failure(index, p, graph, ctx, first, inplace, why, guard=guard)
            self._notify_failed(reversed(self.instruments), p, graph, ctx, failure)
            raise failure
        ctx.history.append(PassRecord(p, changed, seconds))
        pending = list(reversed(self.instruments))
        while pending:
            inst = pending.pop(0)
            try:
                inst.run_after_pass(p, graph, ctx, changed)
            except VerifyError as e:
                ctx.history.pop()  # the pass did not complete: keep history to passes that did
                vf = self._failure(
                    index,
                    p,
                    graph,
                    ctx,
                    first,
                    inplace,
                    f"left a graph that does not verify: {e}",
                    verify_error=e,
                    guard=guard,
                )
                self._notify_failed(pending, p, graph, ctx, vf)
                raise vf from e

    def _failure(
        self,
        index: int,
        p: Pass,
        graph: Graph,
        ctx: PassContext,
        first: int,
        inplace: bool,
        what: str,
        verify_error: VerifyError | None = None,
        guard: ConstantGuard | None = None,
    ) -> PassFailure:
        before = ctx.history[first:]
        ran = ", ".join(f"{r.pass_} ({'changed' if r.changed else 'no change'})" for r in before)
        edited = guard.edited() if guard is not None else []
        if inplace:
            where = "the input graph was modified in place up to the failure"
        elif edited:
            where = (
                f"the input graph's nodes are untouched (the passes ran on a copy), but its constant tensor(s) "
                f"{', '.join(edited)} were modified in place"
            )
        elif guard is None:
            where = (
                "the input graph's nodes are untouched (the passes ran on a copy; "
                "its constant tensors are checked only with verify_each)"
            )
        else:
            where = "the input graph is untouched (the passes ran on a copy)"
        message = (
            f"pass {str(p)!r} (#{index + 1} of {len(self.pipeline)} in {str(self.pipeline)!r}) {what}\n"
            f"  options: {describe_options(p)}\n"
            f"  passes run before it: {ran or 'none (it ran first)'}\n"
            f"  {where}; the graph as the pass left it is this error's .graph"
        )
        previous = [r.pass_ for r in before]
        if verify_error is not None:
            return PassVerificationFailure(message, p, index, previous, graph, verify_error)
        return PassFailure(message, p, index, previous, graph)

    @staticmethod
    def _notify_failed(
        instruments: Iterable[Instrument], p: Pass, graph: Graph, ctx: PassContext, error: PassFailure
    ) -> None:
        """Call ``run_after_pass_failed`` in the given order (the after-hook order)."""
        for inst in instruments:
            inst.run_after_pass_failed(p, graph, ctx, error)


def run_pipeline(
    graph: Graph,
    pipeline: Pipeline | str | Pass | Iterable[Pass],
    *,
    instruments: Sequence[Instrument] | None = None,
    verify_each: bool = True,
    inplace: bool = False,
    ctx: PassContext | None = None,
) -> PipelineResult:
    """``PassManager(pipeline, instruments, verify_each).run(graph, inplace, ctx)`` in one call."""
    return PassManager(pipeline, instruments, verify_each).run(graph, inplace=inplace, ctx=ctx)
