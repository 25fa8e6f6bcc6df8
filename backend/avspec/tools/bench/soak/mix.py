"""The soak's request mix.

gRPC streaming half of the time, HTTP /generate and /generate_stream a quarter each; prompts
from a list; max_tokens uniform in [min_tokens, max_tokens]; temperature 0, 0.7 or 1;
num_draft_tokens 0 or 4 for a quarter of the requests each, else the server's default;
`cancel_fraction` of the streaming requests cancelled after 1-3 responses.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

PROTOCOLS = ("grpc", "http", "http_stream")
PROTOCOL_WEIGHTS = (0.5, 0.25, 0.25)
STREAMING = ("grpc", "http_stream")
TEMPERATURES = (0.0, 0.7, 1.0)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the mix."""

    protocol: str  # one of PROTOCOLS
    prompt: str
    max_tokens: int
    temperature: float
    num_draft_tokens: int | None  # None: the server's default
    seed: int
    cancel_after: int | None  # responses to read before cancelling; None: read to the end


@dataclass(frozen=True)
class Mix:
    """Parameters of the request mix."""

    prompts: list[str]
    min_tokens: int = 16
    max_tokens: int = 64
    cancel_fraction: float = 0.03  # of the streaming requests


def draw_request(rng: random.Random, mix: Mix) -> RequestSpec:
    """Draw one request of the mix (module docstring) with `rng`."""
    protocol = rng.choices(PROTOCOLS, PROTOCOL_WEIGHTS)[0]
    cancel = protocol in STREAMING and rng.random() < mix.cancel_fraction
    return RequestSpec(
        protocol=protocol,
        prompt=rng.choice(mix.prompts),
        max_tokens=rng.randint(mix.min_tokens, mix.max_tokens),
        temperature=rng.choice(TEMPERATURES),
        num_draft_tokens=rng.choice((0, 4, None, None)),
        seed=rng.randrange(1 << 31),
        cancel_after=rng.randint(1, 3) if cancel else None,
    )


def load_prompts(directory: Path, max_bytes: int) -> list[str]:
    """Every prompt of directory/*.jsonl whose UTF-8 length (= tokens) is at most max_bytes."""
    prompts = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompt = json.loads(line)["prompt"]
                if 0 < len(prompt.encode()) <= max_bytes:
                    prompts.append(prompt)
    return prompts
