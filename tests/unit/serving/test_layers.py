"""The serving package is split by the program a module runs in (issue 33; the rule is listed
in `avspec.layers.SERVING_PARTS`), and each part imports only the layers below it: `stages/`
(inside Triton's Python-backend stubs) and `front/` (the public front) never import `host/`
(what starts and guards tritonserver on the host), nor each other; `host/` starts the front but
never imports the stages; the shared modules at the package's top (`repository`, `exposure`)
import none of the three. Function-local imports count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

from avspec.layers import SERVING_PARTS

SERVING = ROOT / "backend/avspec/serving"
PARTS = tuple(SERVING_PARTS)
FORBIDDEN = {**SERVING_PARTS, "shared": PARTS}


def part_of(path: Path) -> str:
    relative = path.relative_to(SERVING).parts
    return relative[0] if len(relative) > 1 and relative[0] in PARTS else "shared"


def imported(source: str) -> set[str]:
    """Every module an `import` or `from ... import` in `source` names (absolute imports)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(part: str, source: str) -> list[str]:
    banned = tuple(f"avspec.serving.{other}" for other in FORBIDDEN[part])
    return sorted(
        name
        for name in imported(source)
        if any(name == b or name.startswith(b + ".") for b in banned)
    )


MODULES = sorted(p for p in SERVING.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SERVING)))
def test_each_serving_module_imports_only_the_layers_below_it(path: Path) -> None:
    assert violations(part_of(path), path.read_text()) == []


def test_the_check_sees_a_forbidden_import_even_inside_a_function() -> None:
    """The broken variant: what server_process.py did before the split (a host module reading a
    helper from the stage side's request handling)."""
    source = "def start():\n    from avspec.serving.stages.requests import served_tokenizer_dir\n"
    assert violations("host", source) == [
        "avspec.serving.stages.requests",
        "avspec.serving.stages.requests.served_tokenizer_dir",
    ]
    assert violations("shared", "from avspec.serving import host\n") == ["avspec.serving.host"]
    assert {part_of(SERVING / "stages/entry.py"), part_of(SERVING / "repository.py")} == {
        "stages",
        "shared",
    }
