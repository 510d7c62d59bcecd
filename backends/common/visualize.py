"""SVG picture of a lowered Program: one box per kernel call, edges labelled with the value's
dtype, shape and scale, fused layers drawn as a group box holding their parts, illegal
layers with a red border whose tooltip (``<title>``) states the broken rule.

Pure Python: a layered layout (rows = ``networkx.topological_generations``, long edges
broken by dummy points, barycentre ordering within rows) and hand-written SVG. Text is a
fixed-width font, so box sizes follow from character counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

import networkx as nx

from backends.common.perf import ValueInfo
from backends.common.program import Instruction, Program, output_names

__all__ = ["Box", "GraphPicture", "format_value", "program_picture", "render_svg"]

FONT = 12
CHAR_W = 7.3  # DejaVu Sans Mono advance at 12 px is 7.22; a little slack keeps text inside its box
LINE_H = 15
PAD_X = 8
PAD_Y = 6
COL_GAP = 22
ROW_GAP = 34
PART_H = 20
LABEL_ZONE = LINE_H + 8
MARGIN = 20
RED = "#d00000"

Scale = float | list[float] | None


@dataclass
class Box:
    """A node of the picture: a kernel call, a program input / output, or a dummy bend point."""

    id: str
    kind: str  # kernel | input | output | dummy
    title: str = ""
    subtitle: str = ""
    tooltip: str = ""
    parts: list[str] = field(default_factory=list)
    illegal: list[str] = field(default_factory=list)
    short: str = ""  # the first broken rule, shown in red inside the box
    label: str = ""  # the value this box produces, drawn under it
    w: float = 0.0
    h: float = 0.0
    x: float = 0.0  # centre
    y: float = 0.0  # top
    row: int = 0

    def size(self) -> None:
        if self.kind == "dummy":
            return
        text_w = max(len(self.title) + (4 if self.illegal else 0), len(self.subtitle), len(self.short)) * CHAR_W
        lines = (2 if self.subtitle else 1) + (1 if self.short else 0)
        self.h = lines * LINE_H + 2 * PAD_Y
        if self.parts:
            text_w = max(text_w, self._parts_w())
            self.h += PART_H + PAD_Y
        self.w = text_w + 2 * PAD_X

    def _parts_w(self) -> float:
        return sum(len(p) * CHAR_W + 12 for p in self.parts) + 14 * (len(self.parts) - 1)

    @property
    def left(self) -> float:
        return self.w / 2

    @property
    def right(self) -> float:
        # the value label sits right of the outgoing stub, which leaves from the box's centre
        return max(self.w / 2, len(self.label) * CHAR_W + 10) if self.label else self.w / 2


@dataclass
class GraphPicture:
    """Boxes and edges (each edge a chain of box ids, dummies between) before and after layout."""

    title: list[str]
    boxes: dict[str, Box]
    edges: list[tuple[list[str], str]]  # (chain of box ids, label)
    #: edge index -> part of the target box it feeds (a fused conv's input -> "conv", addend -> "add")
    part_of_edge: dict[int, int] = field(default_factory=dict)


def format_value(info: ValueInfo | None, scale: Scale) -> str:
    """``dtype shape scale`` of one value; ``scale ?`` for a code tensor whose scale nobody recorded."""
    if info is None:
        return "python value"
    if info.parts:
        return "tuple(" + ", ".join(format_value(t, None if t.dtype == "int64" else scale) for t in info.parts) + ")"
    shape = "x".join(str(d) for d in info.shape) or "scalar"
    if info.dtype not in ("qint8", "qint16", "qint32"):
        return f"{info.dtype} {shape}"
    if scale is None:
        return f"{info.dtype} {shape} scale ?"
    if isinstance(scale, list):
        return f"{info.dtype} {shape} scale per-channel({len(scale)})"
    return f"{info.dtype} {shape} scale {scale:.6g}"


def _dims(v: object) -> str:
    """``[3, 3]`` -> ``3x3``, ``[2, 2]`` as a stride -> ``2``."""
    if isinstance(v, (list, tuple)):
        return "x".join(str(x) for x in v)
    return str(v)


def _same(v: object) -> str:
    if isinstance(v, (list, tuple)) and len(set(v)) == 1:
        return str(v[0])
    return _dims(v)


def _kernel_title(inst: Instruction) -> str:
    a = inst.attrs
    if inst.op == "shape_fn":
        return str(a.get("fn"))
    if inst.op in ("conv2d", "conv_nd"):
        g = int(a.get("groups", 1) or 1)
        return f"{a.get('kind', inst.op)} {_dims(a.get('kernel_size', []))}/s{_same(a.get('stride'))}" + (
            f" g{g}" if g > 1 else ""
        )
    if inst.op in ("maxpool2d", "avgpool2d"):
        k = a.get("kernel_size")
        return f"{inst.op} {_dims(k) if isinstance(k, list) else f'{k}x{k}'}/s{_same(a.get('stride'))}"
    if inst.op in ("lut", "lut16"):
        return f"{inst.op} {a.get('what', '')}".strip()
    if inst.op == "quantize":
        return f"quantize {a.get('dtype', '')}".strip()
    return inst.op


def _parts(inst: Instruction) -> list[str]:
    """The layers a fused kernel call computes (conv, add, activation), or [] when not fused."""
    if inst.op not in ("conv2d", "conv_nd", "linear"):
        return []
    parts = [str(inst.attrs.get("kind", inst.op))]
    if inst.attrs.get("has_add"):
        parts.append("add")
    act = inst.attrs.get("act")
    if act:
        parts.append(str(act))
    return parts if len(parts) > 1 else []


def program_picture(
    program: Program,
    infos: Mapping[str, ValueInfo],
    *,
    scales: Mapping[str, Scale],
    modules: Mapping[str, str],
    module_types: Mapping[str, str],
    violations: Mapping[str, Sequence[tuple[str, str]]],
    title: Sequence[str],
    notes: Mapping[str, str] | None = None,
    shape_ops: bool = False,
) -> GraphPicture:
    """Boxes and edges of ``program``. ``scales``: value -> scale (absent: unknown);
    ``modules`` / ``module_types``: layer -> module name / class; ``violations``: layer -> (short rule,
    full text) of every rule it breaks; ``notes``: layer -> an extra tooltip line. ``shape_ops``:
    also draw the shape arithmetic (``x.size()``, indexing it, int math) that feeds reshapes."""
    boxes: dict[str, Box] = {}
    hidden = set() if shape_ops else _shape_arithmetic(program, infos, violations)
    title = list(title)
    if hidden:
        title.append(f"{len(hidden)} shape-arithmetic call(s) (size, indexing a shape, int math) not drawn")
    producer: dict[str, str] = {}

    def label(v: str) -> str:
        return format_value(infos.get(v), scales.get(v))

    for k, name in enumerate(program.inputs):
        src = program.meta.get("input_source") or []
        how = f" ({src[k]})" if k < len(src) else ""
        b = Box(
            f"in{k}",
            "input",
            title=f"input {name.split('_', 1)[-1]}{how}",
            label=label(name),
            tooltip=f"program input {name}: {label(name)}",
        )
        boxes[b.id] = b
        producer[name] = b.id
    raw_edges: list[tuple[str, str, str]] = []
    part_of_edge: dict[int, int] = {}
    for k, inst in enumerate(program.instructions):
        if k in hidden:
            continue
        mod = modules.get(inst.source, inst.source)
        cls = module_types.get(inst.source, "")
        out = inst.outputs[0] if inst.outputs else ""
        rules = list(violations.get(inst.source, ()))
        tip = [f"kernel {inst.op} (layer {inst.source}, module {mod}{' ' + cls if cls else ''})"]
        if inst.attrs.get("engine"):
            tip.append(f"CPU engine {inst.attrs['engine']}")
        if notes and inst.source in notes:
            tip.append(notes[inst.source])
        tip.append(f"output: {label(out)}" if out else "no output")
        tip += [f"NOT LEGAL on {program.march}: {full}" for _, full in rules]
        parts = _parts(inst)
        b = Box(
            f"k{k}",
            "kernel",
            title=_kernel_title(inst),
            subtitle=mod + (f" ({cls})" if parts and cls else ""),
            tooltip="\n".join(tip),
            parts=parts,
            illegal=[full for _, full in rules],
            short=f"not legal: {rules[0][0]}" if rules else "",
            label=label(out) if out else "",
        )
        boxes[b.id] = b
        for n, v in enumerate(dict.fromkeys(inst.inputs)):
            if v in producer:
                if parts and inst.attrs.get("has_add") and n < 2:
                    part_of_edge[len(raw_edges)] = n  # input 0 enters the conv, input 1 the add
                raw_edges.append((producer[v], b.id, label(v)))
        for o in inst.outputs:
            producer[o] = b.id
    for k, name in enumerate(output_names(program.outputs)):
        b = Box(f"out{k}", "output", title=f"output {k}", tooltip=f"program output {name}: {label(name)}")
        boxes[b.id] = b
        if name in producer:
            raw_edges.append((producer[name], b.id, label(name)))
    for b in boxes.values():
        b.size()
    return GraphPicture(title, boxes, [([u, v], lab) for u, v, lab in raw_edges], part_of_edge)


#: shape_fn functions computing Python ints from shapes (static on the device)
_SCALAR_FNS = frozenset({"size", "dim", "numel", "add", "sub", "mul", "floordiv"})


def _shape_arithmetic(
    program: Program, infos: Mapping[str, ValueInfo], violations: Mapping[str, Sequence[tuple[str, str]]]
) -> set[int]:
    """Indices of instructions that only compute Python ints from shapes (a ``getitem`` of such a
    value included); their results feed reshapes, never tensors' data."""
    scalar: set[str] = set()
    out: set[int] = set()
    for k, inst in enumerate(program.instructions):
        if inst.op != "shape_fn" or any(o in infos for o in inst.outputs) or inst.source in violations:
            continue
        fn = str(inst.attrs.get("fn"))
        if fn in _SCALAR_FNS or (fn == "getitem" and inst.inputs and all(v in scalar for v in inst.inputs)):
            out.add(k)
            scalar.update(inst.outputs)
    return out


# ----------------------------------------------------------------------------- layout


def _layout(pic: GraphPicture) -> tuple[list[list[str]], list[float], list[float]]:
    """Rows of box ids (ordered), each row's top y and height; sets every box's x, y."""
    g = nx.DiGraph()
    g.add_nodes_from(pic.boxes)
    g.add_edges_from((c[0], c[-1]) for c, _ in pic.edges)
    rows: list[list[str]] = [sorted(gen, key=_creation_key) for gen in nx.topological_generations(g)]
    for r, ids in enumerate(rows):
        for i in ids:
            pic.boxes[i].row = r
    # long edges get a dummy box in every row they cross, so they route between boxes
    chains: list[tuple[list[str], str]] = []
    for chain, lab in pic.edges:
        u, v = chain[0], chain[-1]
        ru, rv = pic.boxes[u].row, pic.boxes[v].row
        mid = []
        for r in range(ru + 1, rv):
            d = Box(f"d{len(pic.boxes)}", "dummy", row=r, w=0.0)
            pic.boxes[d.id] = d
            rows[r].append(d.id)
            mid.append(d.id)
        chains.append(([u, *mid, v], lab))
    pic.edges = chains
    preds: dict[str, list[str]] = {i: [] for i in pic.boxes}
    succs: dict[str, list[str]] = {i: [] for i in pic.boxes}
    for chain, _ in chains:
        for a, b in itertools.pairwise(chain):
            preds[b].append(a)
            succs[a].append(b)
    _order(rows, preds, succs)
    _place_x(pic, rows, preds, succs)
    tops: list[float] = []
    heights: list[float] = []
    y = float(MARGIN + LINE_H * (len(pic.title) + 1))
    for ids in rows:
        h = max((pic.boxes[i].h for i in ids), default=0.0)
        for i in ids:
            pic.boxes[i].y = y
        tops.append(y)
        heights.append(h)
        y += h + LABEL_ZONE + ROW_GAP
    return rows, tops, heights


def _creation_key(i: str) -> tuple[int, int]:
    rank = {"in": 0, "k": 1, "out": 2, "d": 3}
    for p in ("out", "in", "k", "d"):
        if i.startswith(p):
            return rank[p], int(i[len(p) :])
    return 4, 0


def _order(rows: list[list[str]], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]]) -> None:
    """Barycentre ordering: sweep down by predecessors' positions, up by successors', a few times."""
    pos = {i: float(k) for ids in rows for k, i in enumerate(ids)}

    def sweep(r: int, nbrs: Mapping[str, list[str]]) -> None:
        ids = rows[r]
        bary = {i: (sum(pos[n] for n in nbrs[i]) / len(nbrs[i]) if nbrs[i] else pos[i]) for i in ids}
        ids.sort(key=lambda i: (bary[i], pos[i]))
        for k, i in enumerate(ids):
            pos[i] = float(k)

    for _ in range(4):
        for r in range(1, len(rows)):
            sweep(r, preds)
        for r in range(len(rows) - 2, -1, -1):
            sweep(r, succs)
    for r in range(1, len(rows)):
        sweep(r, preds)


def _pack(pic: GraphPicture, ids: list[str], desired: list[float]) -> list[float]:
    """Centres as close to ``desired`` as the order and the spacing allow."""
    b = [pic.boxes[i] for i in ids]
    xs = list(desired)
    for k in range(1, len(xs)):
        xs[k] = max(xs[k], xs[k - 1] + b[k - 1].right + COL_GAP + b[k].left)
    shift = sum(x - d for x, d in zip(xs, desired, strict=True)) / max(len(xs), 1)
    xs = [x - shift for x in xs]
    for k in range(len(xs) - 2, -1, -1):
        xs[k] = min(xs[k], xs[k + 1] - b[k + 1].left - COL_GAP - b[k].right)
    return xs


def _place_x(
    pic: GraphPicture, rows: list[list[str]], preds: Mapping[str, list[str]], succs: Mapping[str, list[str]]
) -> None:
    for ids in rows:
        xs = _pack(pic, ids, [0.0] * len(ids))
        for i, x in zip(ids, xs, strict=True):
            pic.boxes[i].x = x

    def align(r: int, nb: Mapping[str, list[str]]) -> None:
        ids = rows[r]
        desired = [sum(pic.boxes[n].x for n in nb[i]) / len(nb[i]) if nb[i] else pic.boxes[i].x for i in ids]
        for i, x in zip(ids, _pack(pic, ids, desired), strict=True):
            pic.boxes[i].x = x

    for _ in range(4):
        for r in range(1, len(rows)):
            align(r, preds)
        for r in range(len(rows) - 2, -1, -1):
            align(r, succs)
    for r in range(1, len(rows)):
        align(r, preds)
    lo = min(b.x - b.left for b in pic.boxes.values())
    for b in pic.boxes.values():
        b.x += MARGIN - lo


# ----------------------------------------------------------------------------- drawing


def _text(x: float, y: float, s: str, cls: str = "", anchor: str = "middle", weight: str = "") -> str:
    extra = f' class="{cls}"' if cls else ""
    extra += f' font-weight="{weight}"' if weight else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{escape(s)}</text>'


def _box_svg(b: Box) -> list[str]:
    x0, y0 = b.x - b.w / 2, b.y
    cls = {"kernel": "kernel", "input": "io", "output": "io"}[b.kind]
    if b.parts:
        cls = "fused"
    if b.illegal:
        cls += " illegal"
    fill = "#eef4ff" if b.kind == "kernel" else "#f2f2f2"
    stroke, sw = (RED, 3) if b.illegal else ("#345", 1.2)
    out = [f'<g class="{cls}" id={quoteattr(b.id)}>', f"<title>{escape(b.tooltip)}</title>"]
    dash = ' stroke-dasharray="5 3"' if b.parts else ""
    out.append(
        f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{b.w:.1f}" height="{b.h:.1f}" rx="5" fill="{fill}" '
        f'stroke="{stroke}" stroke-width="{sw}"{dash}/>'
    )
    y = y0 + PAD_Y + LINE_H - 3
    out.append(_text(b.x, y, b.title, "kernel-name", weight="bold"))
    if b.subtitle:
        y += LINE_H
        out.append(_text(b.x, y, b.subtitle, "source"))
    if b.short:
        y += LINE_H
        out.append(
            f'<text x="{b.x:.1f}" y="{y:.1f}" text-anchor="middle" class="rule" fill="{RED}">{escape(b.short)}</text>'
        )
    if b.parts:
        py = y + PAD_Y + 4
        total = b._parts_w()
        px = b.x - total / 2
        for k, p in enumerate(b.parts):
            pw = len(p) * CHAR_W + 12
            out.append(
                f'<g class="part"><rect x="{px:.1f}" y="{py:.1f}" width="{pw:.1f}" height="{PART_H}" rx="3" '
                f'fill="#ffffff" stroke="#567" stroke-width="1"/>'
            )
            out.append(_text(px + pw / 2, py + PART_H - 6, p) + "</g>")
            if k < len(b.parts) - 1:
                ax = px + pw
                out.append(
                    f'<path d="M{ax + 2:.1f},{py + PART_H / 2:.1f} h10" stroke="#567" '
                    'marker-end="url(#arrow)" fill="none"/>'
                )
            px += pw + 14
    if b.illegal:
        out.append(
            f'<text x="{x0 + b.w - PAD_X:.1f}" y="{y0 + PAD_Y + LINE_H - 3:.1f}" text-anchor="end" '
            f'class="illegal-mark" font-weight="bold" fill="{RED}">!</text>'
        )
    out.append("</g>")
    return out


def _part_centres(b: Box) -> list[float]:
    px = b.x - b._parts_w() / 2
    out = []
    for p in b.parts:
        pw = len(p) * CHAR_W + 12
        out.append(px + pw / 2)
        px += pw + 14
    return out


def render_svg(pic: GraphPicture) -> str:
    """Lay ``pic`` out and return the SVG document."""
    rows, tops, heights = _layout(pic)
    row_bottom = [t + h for t, h in zip(tops, heights, strict=True)]
    width = max(b.x + b.right for b in pic.boxes.values()) + MARGIN
    width = max(width, max(len(t) for t in pic.title) * CHAR_W + 2 * MARGIN)
    height = (row_bottom[-1] if row_bottom else 0.0) + LABEL_ZONE + MARGIN
    # incoming ports spread across each box's top edge, ordered by where the edges come from
    incoming: dict[str, list[tuple[float, int]]] = {}
    for k, (chain, _) in enumerate(pic.edges):
        incoming.setdefault(chain[-1], []).append((pic.boxes[chain[-2]].x, k))
    port: dict[int, float] = {}
    for v, lst in incoming.items():
        b = pic.boxes[v]
        lst.sort()
        for n, (_, k) in enumerate(lst):
            port[k] = b.x - b.w / 2 + b.w * (n + 1) / (len(lst) + 1)
            if k in pic.part_of_edge:
                port[k] = _part_centres(b)[pic.part_of_edge[k]]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" '
        f'font-size="{FONT}">',
        f"<title>{escape(pic.title[0])}</title>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#456"/></marker></defs>',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
    ]
    for k, line in enumerate(pic.title):
        out.append(
            _text(MARGIN, MARGIN + LINE_H * (k + 0.7), line, "header", anchor="start", weight="bold" if k == 0 else "")
        )
    out.append('<g class="edges" fill="none" stroke="#456" stroke-width="1.2">')
    for k, (chain, lab) in enumerate(pic.edges):
        out.append(
            f'<g class="edge"><title>{escape(lab)}</title>'
            f'<path d="{_edge_path(pic, chain, port[k], row_bottom)}" marker-end="url(#arrow)"/></g>'
        )
    out.append("</g>")
    out.append('<g class="nodes">')
    for ids in rows:
        for i in ids:
            if pic.boxes[i].kind != "dummy":
                out.extend(_box_svg(pic.boxes[i]))
    out.append("</g>")
    out.append('<g class="edge-labels" fill="#1a3d6b">')
    for b in pic.boxes.values():
        if b.label and b.kind != "dummy" and any(c[0] == b.id for c, _ in pic.edges):
            out.append(_text(b.x + 6, b.y + b.h + LINE_H - 1, b.label, "edge-label", anchor="start"))
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


def _edge_path(pic: GraphPicture, chain: list[str], end_x: float, row_bottom: list[float]) -> str:
    u = pic.boxes[chain[0]]
    pts: list[tuple[float, float]] = [(u.x, u.y + u.h), (u.x, row_bottom[u.row] + LABEL_ZONE)]
    for d in chain[1:-1]:
        b = pic.boxes[d]
        pts += [(b.x, b.y - 2), (b.x, row_bottom[b.row] + LABEL_ZONE)]
    v = pic.boxes[chain[-1]]
    pts.append((end_x, v.y - 1))
    # straight runs alternate with S-curves: stub down, curve to the next row, straight through it ...
    d = f"M{pts[0][0]:.1f},{pts[0][1]:.1f} L{pts[1][0]:.1f},{pts[1][1]:.1f}"
    for k in range(1, len(pts) - 1, 2):
        (x0, y0), (x1, y1) = pts[k], pts[k + 1]
        ym = (y0 + y1) / 2
        d += f" C{x0:.1f},{ym:.1f} {x1:.1f},{ym:.1f} {x1:.1f},{y1:.1f}"
        if k + 2 < len(pts):
            d += f" L{pts[k + 2][0]:.1f},{pts[k + 2][1]:.1f}"
    return d
