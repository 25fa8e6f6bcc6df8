"""Fixtures of the OpenAI routes' tests: the official client on the front with the pair's tokenizer
(`openai_front`, in the parent conftest.py, which the playground's test shares).
"""

from __future__ import annotations

import pytest
from helpers.front_fakes import official_client


@pytest.fixture
def client(openai_front):
    with official_client(openai_front) as official:
        yield official
