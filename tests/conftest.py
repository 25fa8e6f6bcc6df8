"""Fixtures shared across test folders (helpers without fixtures live in tests/helpers/)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run far faster on one thread on a loaded 2-core machine (and need no grad).

    A module opts in with `pytestmark = pytest.mark.usefixtures("single_thread")`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        yield
    torch.set_num_threads(threads)
