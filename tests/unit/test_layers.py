"""The package's import graph: no import cycle, no import from a lower layer to a higher one.

Every import statement counts: top-level, function-local and `if TYPE_CHECKING:` ones, relative
imports resolved. The layers are avspec.layers.LAYERS. The checker also runs on small broken
fake packages written to tmp_path, so these tests can fail.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import avspec
from avspec.layers import LAYERS

PACKAGE = Path(avspec.__file__).parent


@dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. avspec.engine.step
    imported: str  # the avspec module it names (a package's __init__ is the package name)
    line: int
    statement: str  # the import statement as written (normalised by ast.unparse)


def modules_of(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (a package is its __init__)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(package_dir: Path) -> list[Import]:
    """Every import of a package module by a package module, wherever the statement stands."""
    modules = modules_of(package_dir)
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    if node.level - 1 >= len(here):
                        raise ValueError(f"{path}:{node.lineno}: relative import beyond the top")
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                # `from a import b` names the module a.b when there is one, else a name in a
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            statement = ast.unparse(node)
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name in a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.append(Import(name, target, node.lineno, statement))
    return found


def find_cycles(modules: list[str], imports: list[Import]) -> list[list[Import]]:
    """One shortest cycle through each strongly connected group of modules (Tarjan)."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in imports:
        graph[imp.importer].setdefault(imp.imported, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for group in groups:
        start, members = group[0], set(group)
        previous: dict[str, Import] = {}
        frontier = [start]
        while frontier and start not in previous:  # breadth-first back to start
            following = []
            for v in frontier:
                for w, imp in sorted(graph[v].items()):
                    if w in members and w not in previous:
                        previous[w] = imp
                        following.append(w)
            frontier = following
        cycle, at = [], start
        while True:
            cycle.append(previous[at])
            at = previous[at].importer
            if at == start:
                break
        cycles.append(cycle[::-1])
    return cycles


def layer_problems(package_dir: Path, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Why the package breaks the layering: cycles, upward imports, unlisted or unknown names."""
    package = package_dir.name
    modules = modules_of(package_dir)
    imports = imports_of(package_dir)
    problems = []

    rank = {}
    for i, layer in enumerate(layers):
        for entry in layer:
            if entry in rank:
                problems.append(f"{entry!r} is listed in two layers")
            rank[entry] = i
    top_level = {m.split(".")[1] for m in modules if m != package}
    listed = set(rank)
    problems += [f"{package}.{n} belongs to no layer: list it" for n in sorted(top_level - listed)]
    problems += [f"layer entry {n!r} is no module of {package}" for n in sorted(listed - top_level)]

    def layer_of(module: str) -> int | None:
        return 0 if module == package else rank.get(module.split(".")[1])

    def describe(i: int | None) -> str:
        return "no layer" if i is None else f"layer {i} {layers[i]}"

    for cycle in find_cycles(list(modules), imports):
        chain = " -> ".join([cycle[0].importer] + [imp.imported for imp in cycle])
        where = "; ".join(f"{imp.importer}:{imp.line} {imp.statement}" for imp in cycle)
        problems.append(f"import cycle {chain} ({where})")
    for imp in imports:
        low, high = layer_of(imp.importer), layer_of(imp.imported)
        if low is not None and high is not None and high > low:
            problems.append(
                f"{imp.importer} ({describe(low)}) imports {imp.imported} ({describe(high)}), "
                f"a higher layer: line {imp.line}: {imp.statement}"
            )
    return problems


def test_avspec_has_no_cycle_and_no_upward_import() -> None:
    problems = layer_problems(PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def test_the_walk_sees_function_local_and_relative_imports_of_avspec() -> None:
    """The graph is not empty by mistake: known edges of every kind are found."""
    edges = {(i.importer, i.imported) for i in imports_of(PACKAGE)}
    assert ("avspec.engine.step", "avspec.engine.draft_stage") in edges
    assert ("avspec.contract", "avspec.checks") in edges
    assert ("avspec.serving.front", "avspec.serving.front.server") in edges  # a package's init
    assert len(edges) > 100


# --- the same checker on small fake packages -------------------------------------------------

FAKE_LAYERS = (("base",), ("low",), ("high",))


def write_fake(root: Path, files: dict[str, str]) -> Path:
    """A package `fake` under root: base.py, low/{__init__,a,b}.py, high/{__init__,top,leaf}.py,
    with the given files' contents replaced or added (leaf imports nothing)."""
    contents = {
        "__init__.py": "",
        "base.py": "VALUE = 1\n",
        "low/__init__.py": "",
        "low/a.py": "from fake.base import VALUE\nfrom . import b\n",
        "low/b.py": "from ..base import VALUE\n",
        "high/__init__.py": "from .top import run\n",
        "high/top.py": "import fake.low.a\nfrom fake.low import b\n\ndef run():\n    return b\n",
        "high/leaf.py": "LEAF = 2\n",
        **files,
    }
    for name, text in contents.items():
        path = root / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "fake"


def test_a_clean_fake_package_passes(tmp_path: Path) -> None:
    package = write_fake(tmp_path, {})
    assert layer_problems(package, FAKE_LAYERS) == []
    edges = {(i.importer, i.imported) for i in imports_of(package)}
    assert edges == {
        ("fake.low.a", "fake.base"), ("fake.low.a", "fake.low.b"), ("fake.low.b", "fake.base"),
        ("fake.high", "fake.high.top"), ("fake.high.top", "fake.low.a"),
        ("fake.high.top", "fake.low.b"),
    }  # fmt: skip


def test_a_cycle_hidden_in_a_function_is_named(tmp_path: Path) -> None:
    package = write_fake(tmp_path, {"low/b.py": "def late():\n    from .a import VALUE\n"})
    assert layer_problems(package, FAKE_LAYERS) == [
        "import cycle fake.low.a -> fake.low.b -> fake.low.a "
        "(fake.low.a:2 from . import b; fake.low.b:2 from .a import VALUE)"
    ]


def test_a_cycle_across_layers_is_named_as_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    package = write_fake(tmp_path, {"base.py": "import fake.high.top\n"})
    problems = layer_problems(package, FAKE_LAYERS)
    assert problems[0].startswith("import cycle fake.base -> fake.high.top -> fake.low.")
    assert problems[1:] == [
        "fake.base (layer 0 ('base',)) imports fake.high.top (layer 2 ('high',)), "
        "a higher layer: line 1: import fake.high.top"
    ]


def test_an_upward_import_is_named_with_both_layers(tmp_path: Path) -> None:
    package = write_fake(tmp_path, {"low/b.py": "from fake.high.leaf import LEAF\n"})
    assert layer_problems(package, FAKE_LAYERS) == [
        "fake.low.b (layer 1 ('low',)) imports fake.high.leaf (layer 2 ('high',)), "
        "a higher layer: line 1: from fake.high.leaf import LEAF"
    ]


@pytest.mark.parametrize(
    ("text", "statement"),
    [
        ("def helper():\n    from ..high import leaf\n", "line 2: from ..high import leaf"),
        (
            "import typing\nif typing.TYPE_CHECKING:\n    from fake.high.leaf import LEAF\n",
            "line 3: from fake.high.leaf import LEAF",
        ),
    ],
    ids=["function-local-relative", "type-checking"],
)
def test_a_hidden_upward_import_is_caught(tmp_path: Path, text: str, statement: str) -> None:
    package = write_fake(tmp_path, {"low/b.py": text})
    [problem] = layer_problems(package, FAKE_LAYERS)
    assert "fake.low.b (layer 1 ('low',)) imports fake.high.leaf (layer 2 ('high',))" in problem
    assert problem.endswith(statement)


def test_unlisted_and_stale_layer_entries_are_refused(tmp_path: Path) -> None:
    package = write_fake(tmp_path, {"extra.py": ""})
    assert layer_problems(package, (("base", "gone"), ("low",), ("high", "low"))) == [
        "'low' is listed in two layers",
        "fake.extra belongs to no layer: list it",
        "layer entry 'gone' is no module of fake",
    ]
