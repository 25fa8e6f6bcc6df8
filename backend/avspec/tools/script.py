"""The argument parser of a client script, from its module docstring."""

from __future__ import annotations

import argparse


def doc_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose description is the docstring's first paragraph and whose epilog (printed
    as written) is the rest: the usage examples a script's docstring ends with."""
    text = doc or ""
    head, _, rest = text.partition("\n\n")
    return argparse.ArgumentParser(
        description=head, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest
    )
