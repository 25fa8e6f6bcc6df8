"""What a generation request may ask for: checked at submission, before it is queued.

The scheduler (avspec.engine.scheduler) refuses a request with ValueError (the message names the
field and its bound) when its prompt is empty, `max_tokens` < 1, `num_draft_tokens` outside
0..K, `temperature` outside 0..MAX_TEMPERATURE, `top_p` outside (0, 1], its client not a
string, or when it could outgrow the stages' caches: prompt + max_tokens + K positions
(`positions_needed`) beyond `max_context` or the shared KV pool's cells.
"""

from __future__ import annotations

from avspec.engine.sequence import GenerationRequest

MAX_TEMPERATURE = 100.0  # a request's largest temperature (at 100 sampling is near uniform)


def positions_needed(request: GenerationRequest, max_draft_tokens: int) -> int:
    """Positions a request may hold in the stages' caches at most."""
    return len(request.prompt_ids) + request.max_tokens + max_draft_tokens


def validate_request(
    request: GenerationRequest,
    max_draft_tokens: int,
    max_context: int,
    kv_pool_tokens: int | None,
) -> None:
    """Raise ValueError if `request` asks for what the scheduler cannot serve."""
    if not request.prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if not 0 <= request.num_draft_tokens <= max_draft_tokens:
        raise ValueError(
            f"num_draft_tokens {request.num_draft_tokens} outside 0..{max_draft_tokens}"
        )
    if not 0 <= request.temperature <= MAX_TEMPERATURE:
        raise ValueError(
            f"temperature must lie in 0..{MAX_TEMPERATURE:g} (0 = greedy), "
            f"got {request.temperature}"
        )
    if not 0 < request.top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {request.top_p}")
    if not isinstance(request.client, str):
        raise ValueError(f"client must be a string, got {type(request.client).__name__}")
    need = positions_needed(request, max_draft_tokens)
    limits = (
        (max_context, "max_context"),
        (kv_pool_tokens, "the KV pool's cells (kv_pool_tokens)"),
    )
    for limit, name in limits:
        if limit is not None and need > limit:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)}) + max_tokens ({request.max_tokens}) + "
                f"draft tokens ({max_draft_tokens}) = {need} exceeds {name} {limit}"
            )
