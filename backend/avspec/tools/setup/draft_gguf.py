"""Write the draft checkpoint as a GGUF file, for the llama.cpp engine (which loads GGUF only).

    python -m avspec.tools.setup.draft_gguf --draft models/draft --out models/draft/model.gguf
    python -m avspec.tools.setup.draft_gguf --draft models/draft --out /tmp/draft.gguf --type f32

The draft is a Hugging Face Llama checkpoint (`make models` assembles it); the target exists
as the pinned GGUF in `build/gguf-cache/downloads`. That file supplies the tokenizer metadata
(`--tokenizer-gguf`: the draft shares the target's tokenizer exactly) and, by default, the
draft's embedding as stored there (`--shared-embedding-from`): the draft's embedding was
dequantized from the target's Q8_0 `token_embd.weight`, so those blocks are copied unchanged
(checked first) instead of quantized a second time; `--no-shared-embedding` quantizes it like
the other matrices. The matrices are stored as `--type` (default q8_0), norms as F32
(`avspec.runtime.gguf.writer`). Prints the file written, its size and its tensor types.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from avspec.runtime.gguf.reader import GGUFFile
from avspec.runtime.gguf.writer import TENSOR_TYPES, TOKEN_EMBD, write_llama_gguf
from avspec.runtime.hf_files import GGUF_FILE
from avspec.tools.setup.fetch_target import DEFAULT_CACHE

DEFAULT_TARGET_GGUF = DEFAULT_CACHE / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.setup.draft_gguf", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--draft", type=Path, default=Path("models/draft"))
    parser.add_argument("--out", type=Path, help=f"default: <draft>/{GGUF_FILE}")
    parser.add_argument("--type", choices=sorted(TENSOR_TYPES), default="q8_0")
    parser.add_argument("--tokenizer-gguf", type=Path, default=DEFAULT_TARGET_GGUF)
    shared = parser.add_mutually_exclusive_group()
    shared.add_argument(
        "--shared-embedding-from", type=Path, help="default: the --tokenizer-gguf file"
    )
    shared.add_argument("--no-shared-embedding", action="store_true")
    return parser.parse_args(argv)


def describe(path: Path) -> str:
    """One line: the file's size and how many tensors of each stored type it holds."""
    gguf = GGUFFile(path)
    types = Counter(gguf.tensor_type(n) for n in gguf.tensor_names())
    counts = ", ".join(f"{kind} x {n}" for kind, n in types.most_common())
    return (
        f"{path} ({path.stat().st_size / 1e6:.1f} MB; {counts}; "
        f"{TOKEN_EMBD} {gguf.tensor_type(TOKEN_EMBD)})"
    )


def error(message: str) -> None:
    print(f"[draft_gguf] error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or args.draft / GGUF_FILE
    shared = None if args.no_shared_embedding else args.shared_embedding_from
    if shared is None and not args.no_shared_embedding:
        shared = args.tokenizer_gguf
    if not args.tokenizer_gguf.is_file() and args.tokenizer_gguf == DEFAULT_TARGET_GGUF:
        error(f"{args.tokenizer_gguf} is missing: run `make models` first (it fetches it)")
        return 1
    try:
        write_llama_gguf(args.draft, out, args.tokenizer_gguf, args.type, shared)
    except (ValueError, OSError) as err:
        error(str(err))
        return 1
    print(f"[draft_gguf] wrote {describe(out)}")
    if shared is not None:
        print(f"[draft_gguf] {TOKEN_EMBD}: the stored blocks of {shared}, copied unchanged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
