#!/usr/bin/env python3
"""Fill the `${name}` placeholders of the GPU model repository templates into a new directory.

Copies the template repository (default: model_repository_gpu/) to --output and replaces every
`${name}` in its .pbtxt files with the value given by --set name=value (or a --values JSON
file). It fails, writing nothing, when a placeholder has no value, a value fills no placeholder
(a typo must not pass), or a value would break the pbtxt string it lands in. The templates
themselves are never edited.

    .venv/bin/python client/fill_template.py --output build/model_repository_gpu \\
        --set engine_dir=/engines/target --set vocab_size=32000 ...

Exit status: 0 on success, 2 on bad values or arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = ROOT / "model_repository_gpu"
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BAD_VALUE = re.compile(r'["\\\n$]')


class TemplateError(ValueError):
    """A placeholder without value, a value without placeholder, or a malformed value."""


def placeholders(text: str) -> set[str]:
    """Names of the `${name}` placeholders in `text` (malformed names raise TemplateError)."""
    names = set(PLACEHOLDER.findall(text))
    bad = sorted(n for n in names if not _NAME.fullmatch(n))
    if bad:
        raise TemplateError(f"malformed placeholder name(s): {bad}")
    return names


def fill_text(text: str, values: Mapping[str, str], source: str = "template") -> str:
    """Replace every placeholder of `text`; TemplateError naming `source` if one has no value."""
    missing = sorted(placeholders(text) - set(values))
    if missing:
        raise TemplateError(f"{source}: no value for {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda m: str(values[m[1]]), text)


def check_values(values: Mapping[str, str]) -> None:
    """Values are substituted inside pbtxt strings and numbers: no quotes, backslashes, `$`."""
    for name, value in values.items():
        if not _NAME.fullmatch(name):
            raise TemplateError(f"bad placeholder name {name!r}")
        if not str(value) or _BAD_VALUE.search(str(value)):
            raise TemplateError(
                f"{name}: value {value!r} is empty or holds a quote, \\, $ or newline"
            )


def fill_repository(
    template_dir: Path, output_dir: Path, values: Mapping[str, str], force: bool = False
) -> list[Path]:
    """Copy `template_dir` to `output_dir`, filling every .pbtxt; return the filled files.

    Everything is checked before anything is written. An existing output_dir is replaced only
    with `force`.
    """
    template_dir, output_dir = Path(template_dir), Path(output_dir)
    if not template_dir.is_dir():
        raise TemplateError(f"no template directory {template_dir}")
    if output_dir.resolve() == template_dir.resolve():
        raise TemplateError("output directory must differ from the template directory")
    if output_dir.exists() and not force:
        raise TemplateError(f"{output_dir} exists (use --force to replace it)")
    check_values(values)
    templates = sorted(template_dir.rglob("*.pbtxt"))
    filled = {
        path.relative_to(template_dir): fill_text(path.read_text(), values, str(path))
        for path in templates
    }
    used = set().union(*(placeholders(p.read_text()) for p in templates)) if templates else set()
    unused = sorted(set(values) - used)
    if unused:
        raise TemplateError(f"value(s) given for no placeholder: {', '.join(unused)}")
    if output_dir.exists():
        shutil.rmtree(output_dir)
    shutil.copytree(template_dir, output_dir, ignore=shutil.ignore_patterns("__pycache__"))
    for relative, text in filled.items():
        (output_dir / relative).write_text(text)
    return [output_dir / r for r in filled]


def parse_values(pairs: Sequence[str], values_file: Path | None) -> dict[str, str]:
    """Values from a JSON object file, then `name=value` pairs (which win)."""
    values: dict[str, str] = {}
    if values_file is not None:
        document = json.loads(values_file.read_text())
        if not isinstance(document, dict):
            raise TemplateError(f"{values_file}: expected a JSON object of name -> value")
        values.update({str(k): str(v) for k, v in document.items()})
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise TemplateError(f"--set expects name=value, got {pair!r}")
        values[name.strip()] = value
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", type=Path, default=TEMPLATE_DIR, help="template repository")
    parser.add_argument("--output", type=Path, help="directory to write (required to fill)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--values", type=Path, help="JSON object of placeholder values")
    parser.add_argument("--force", action="store_true", help="replace an existing --output")
    parser.add_argument("--list", action="store_true", help="print the placeholders and exit")
    args = parser.parse_args(argv)
    try:
        if args.list:
            names = set().union(
                *(placeholders(p.read_text()) for p in args.template.rglob("*.pbtxt"))
            )
            print("\n".join(sorted(names)))
            return 0
        if args.output is None:
            parser.error("--output is required unless --list")
        values = parse_values(args.set, args.values)
        written = fill_repository(args.template, args.output, values, force=args.force)
    except (TemplateError, OSError, json.JSONDecodeError) as err:
        print(f"fill_template: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
