"""User passes from outside the tree: ``qir opt --load`` and the ``qir.passes`` entry-point group."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import passes
from passes.base import PASS_REGISTRY
from qir.cli.main import main

IR = """graph @G(%x: tensor<1x4xf32>) {
  %r: tensor<1x4xf32> = relu(%x)
  return %r
}
"""

USER_PASS = '''
from typing import ClassVar

import attrs

from passes import Pass, PassContext, register_pass


@register_pass
@attrs.frozen
class DropRelu(Pass):
    """Bypass every relu (a user's pass)."""

    name: ClassVar[str] = "{name}"

    def apply(self, ctx: PassContext, graph) -> bool:
        changed = False
        for node in list(graph.nodes):
            if node.op.name == "relu":
                node.replace_all_uses_with(node.operands[0])
                graph.erase_node(node)
                changed = True
        return changed
'''


@pytest.fixture(autouse=True)
def restore_registry() -> Iterator[None]:
    modules = set(sys.modules)
    yield
    # forget the user modules this test imported and the passes they registered
    gone = {name for name in set(sys.modules) - modules if "plug" in name or name.startswith("qir_user_passes_")}
    for name in gone:
        del sys.modules[name]
    for name, cls in list(PASS_REGISTRY.items()):
        if cls.__module__ in gone:
            del PASS_REGISTRY[name]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def one_line_error(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def test_opt_load_file_and_module(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = tmp_path / "g.qir"
    src.write_text(IR)
    code, out, err = run_cli(capsys, "opt", str(src), "-p", "drop-relu")
    assert code == 1 and "unknown pass 'drop-relu'" in err
    (tmp_path / "my_passes.py").write_text(USER_PASS.format(name="drop-relu"))
    code, out, err = run_cli(capsys, "opt", str(src), "--load", str(tmp_path / "my_passes.py"), "-p", "drop-relu")
    assert code == 0, err
    assert "relu(" not in out and "return %x" in out
    # a module name, found on sys.path
    pkg = tmp_path / "userplug_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "more.py").write_text(USER_PASS.format(name="drop-relu-2"))
    sys.path.insert(0, str(tmp_path))
    try:
        code, out, err = run_cli(
            capsys, "opt", str(src), "--load", "userplug_pkg.more", "--load", str(tmp_path / "my_passes.py"),
            "-p", "drop-relu-2,drop-relu",
        )  # fmt: skip
    finally:
        sys.path.remove(str(tmp_path))
    assert code == 0 and "relu(" not in out, err


def test_opt_load_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = tmp_path / "g.qir"
    src.write_text(IR)
    code, _, err = run_cli(capsys, "opt", str(src), "--load", str(tmp_path / "missing.py"))
    assert code == 1
    one_line_error(err, "missing.py", "no such file")
    bad = tmp_path / "bad_passes.py"
    bad.write_text("import no_such_dependency_xyz\n")
    code, _, err = run_cli(capsys, "opt", str(src), "--load", str(bad))
    assert code == 1
    one_line_error(err, "bad_passes.py", "ModuleNotFoundError", "no_such_dependency_xyz")
    syntax = tmp_path / "syntax_passes.py"
    syntax.write_text("def f(:\n")
    code, _, err = run_cli(capsys, "opt", str(src), "--load", str(syntax))
    assert code == 1
    one_line_error(err, "syntax_passes.py", "SyntaxError")
    code, _, err = run_cli(capsys, "opt", str(src), "--load", "no_such_pkg_xyz.passes")
    assert code == 1
    one_line_error(err, "no_such_pkg_xyz.passes", "ModuleNotFoundError")


def make_distribution(root: Path, dist: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    """A distribution as pip would leave it: modules plus ``<dist>-1.2.dist-info`` with entry points."""
    info = root / f"{dist}-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{passes.ENTRY_POINT_GROUP}]\n{lines}\n")
    for name, text in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(text))


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    def install() -> None:
        make_distribution(
            tmp_path,
            "fakeplug",
            {
                "plug-drop-relu": "fakeplug_passes",
                "plug-broken": "fakeplug_broken:Pass",
                "plug-unregistered": "fakeplug_unregistered:Quiet",
            },
            {
                "fakeplug_passes": USER_PASS.format(name="plug-drop-relu"),
                "fakeplug_broken": "raise RuntimeError('plugin is broken on purpose')\n",
                "fakeplug_unregistered": (
                    "from typing import ClassVar\nfrom passes import Pass\n"
                    "class Quiet(Pass):\n    name: ClassVar[str] = 'plug-unregistered'\n"
                ),
            },
        )
        monkeypatch.syspath_prepend(str(tmp_path))

    return install


def test_entry_point_plugin_listed_and_runs(
    installed_plugin: Callable[[], None], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert "plug-drop-relu" not in passes.available_passes()
    installed_plugin()
    assert "fakeplug_passes" not in sys.modules  # listed lazily: nothing imported yet
    assert {"plug-drop-relu", "plug-broken", "plug-unregistered"} <= set(passes.available_passes())
    code, out, err = run_cli(capsys, "passes")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("plug-drop-relu"))
    assert "[plugin: fakeplug 1.2]" in line and "Bypass every relu" in line
    broken = next(x for x in out.splitlines() if x.startswith("plug-broken"))
    assert "BROKEN PLUGIN" in broken and "fakeplug 1.2" in broken and "broken on purpose" in broken
    unregistered = next(x for x in out.splitlines() if x.startswith("plug-unregistered"))
    assert "not decorated with @register_pass" in unregistered
    assert "absorb-bn" in out  # the others are still listed
    src = tmp_path / "g.qir"
    src.write_text(IR)
    code, out, err = run_cli(capsys, "opt", str(src), "-p", "remove-identity,plug-drop-relu")
    assert code == 0 and "relu(" not in out, err
    code, out, err = run_cli(capsys, "opt", str(src), "-p", "plug-broken")
    assert code == 1
    one_line_error(err, "plug-broken", "fakeplug 1.2", "RuntimeError", "broken on purpose")


def test_entry_point_plugin_in_run_pipeline(installed_plugin: Callable[[], None]) -> None:
    from qir.ir.parser import parse_graph

    installed_plugin()
    result = passes.run_pipeline(parse_graph(IR), "plug-drop-relu,dce")
    assert all(n.op.name != "relu" for n in result.graph.nodes)
    with pytest.raises(passes.PipelineError, match=r"plug-broken.*broken on purpose"):
        passes.run_pipeline(parse_graph(IR), "plug-broken")
