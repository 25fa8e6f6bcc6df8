"""Read and write the JSON objects of configuration files, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, error: type[ValueError]) -> dict[str, Any] | None:
    """The JSON object in `path`; None when the file does not exist.

    Raises `error` (a ValueError subclass of the caller's) naming the file when it is not valid
    UTF-8 JSON or does not hold an object.
    """
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: must hold a JSON object")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` to `path` as indented, key-sorted UTF-8 JSON with a final newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
