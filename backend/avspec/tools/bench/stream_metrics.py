"""Streaming latency of OpenAI-API requests, as AIPerf defines it.

Triton-free and unit-tested on constructed timestamps; `client/bench_openai.py` feeds it the
arrival times of each request's chunks. A content chunk is one whose text is not empty (a chat
stream's opening role chunk, the last chunk with only `finish_reason` and the usage chunk are
not), as in AIPerf's `content_responses`. Per request (AIPerf 0.13's metric classes):

- TTFT: first content chunk - request sent;
- request latency: last content chunk - request sent;
- ITL (inter-token latency): (last content chunk - first content chunk) / (output tokens - 1),
  output tokens from the usage the server reports; undefined below 2 tokens. AIPerf run with
  `--per-chunk-usage` divides by (output tokens - tokens of the first content chunk) instead
  (`itl_first_chunk`), which is what a stream that sends several tokens per chunk, as
  speculative decoding does, needs for the decode tokens;
- ICL (inter-chunk latency): every gap between consecutive content chunks (pooled over requests
  for the statistics). With several tokens per chunk the gaps are that many times ITL: per
  request, mean ICL / ITL = (output tokens - 1) / (content chunks - 1);
- output tokens/s per user: 1 / ITL.

Over a phase: duration = last content chunk of any request - first request sent (AIPerf's
benchmark duration); output tokens/s = output tokens of the successful requests / duration;
request throughput = successful requests / duration. This project's gRPC benchmark
(`avspec.tools.bench.frontier`) defines ITL per token instead (each gap split evenly over the tokens
of its response): per request its mean is `itl_first_chunk`, its percentiles are over tokens.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from avspec.tools.bench.frontier import percentile


@dataclass
class StreamRecord:
    """One streamed request: seconds on one monotonic clock, counts from the server."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)  # content chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each content chunk completed
    output_tokens: int = 0  # usage.completion_tokens
    drafted: int = 0  # the response's `speculative` totals
    verified: int = 0
    accepted: int = 0
    steps: int = 0
    error: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The record with times in ms after `sent` (what the JSON output keeps)."""
        return {
            "chunk_ms": [round(1e3 * (t - self.sent), 3) for t in self.chunk_times],
            "chunk_tokens": self.chunk_tokens,
            "output_tokens": self.output_tokens,
            "drafted": self.drafted,
            "verified": self.verified,
            "accepted": self.accepted,
            "steps": self.steps,
            "error": self.error,
        }


def time_to_first_token(record: StreamRecord) -> float:
    """Seconds from sending to the first content chunk; NaN if none came."""
    return record.chunk_times[0] - record.sent if record.chunk_times else math.nan


def request_latency(record: StreamRecord) -> float:
    """Seconds from sending to the last content chunk; NaN if none came."""
    return record.chunk_times[-1] - record.sent if record.chunk_times else math.nan


def inter_token_latency(record: StreamRecord, first_chunk_tokens: bool = False) -> float:
    """Seconds per decode token: (last - first content chunk) / (output tokens - 1), or, with
    `first_chunk_tokens`, / (output tokens - tokens of the first chunk) (AIPerf with
    `--per-chunk-usage`); NaN when no token is left to divide by."""
    if not record.chunk_times:
        return math.nan
    first = record.chunk_tokens[0] if first_chunk_tokens and record.chunk_tokens else 1
    decode_tokens = record.output_tokens - first
    if decode_tokens < 1 or record.output_tokens < 2:
        return math.nan
    return (record.chunk_times[-1] - record.chunk_times[0]) / decode_tokens


def inter_chunk_gaps(record: StreamRecord) -> list[float]:
    """Seconds between consecutive content chunks (none with fewer than two chunks)."""
    times = record.chunk_times
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _stats(name: str, values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """median, p90, p99, mean, min and max of `values` x `scale` (NaN for no values)."""
    values = [v * scale for v in values if not math.isnan(v)]
    return {
        f"{name}_median": percentile(values, 50),
        f"{name}_p90": percentile(values, 90),
        f"{name}_p99": percentile(values, 99),
        f"{name}_mean": statistics.fmean(values) if values else math.nan,
        f"{name}_min": min(values, default=math.nan),
        f"{name}_max": max(values, default=math.nan),
    }


def summarize(records: Sequence[StreamRecord]) -> dict[str, float]:
    """Statistics of one phase (see the module doc). Failed requests count only in `errors`,
    requests that ended without a content chunk (EOS first) only in `empty` (AIPerf counts
    both as errors: a record without content is invalid there)."""
    ok = [r for r in records if r.error is None and r.chunk_times]
    errors = sum(r.error is not None for r in records)
    counts: dict[str, float] = {
        "requests": len(ok),
        "errors": errors,
        "empty": len(records) - len(ok) - errors,
    }
    if not ok:
        return counts
    duration = max(r.chunk_times[-1] for r in ok) - min(r.sent for r in records)
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    itl = [inter_token_latency(r) for r in ok]
    first = [r.chunk_tokens[0] for r in ok if r.chunk_tokens]
    drafted, verified, accepted, steps = (
        sum(getattr(r, key) for r in ok) for key in ("drafted", "verified", "accepted", "steps")
    )
    return {
        **counts,
        "duration_s": duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "requests_per_s": len(ok) / duration,
        **_stats("ttft_ms", [time_to_first_token(r) for r in ok], 1e3),
        **_stats("latency_ms", [request_latency(r) for r in ok], 1e3),
        **_stats("itl_ms", itl, 1e3),
        **_stats("itl_first_chunk_ms", [inter_token_latency(r, True) for r in ok], 1e3),
        **_stats("icl_ms", [gap for r in ok for gap in inter_chunk_gaps(r)], 1e3),
        **_stats("tokens_per_s_per_user", [1 / x for x in itl if x > 0]),
        "output_tokens_mean": tokens / len(ok),
        "tokens_per_chunk": tokens / chunks,
        "first_chunk_tokens_mean": statistics.fmean(first) if first else math.nan,
        "drafted": drafted,
        "verified": verified,
        "accepted": accepted,
        "steps": steps,
        "acceptance_rate": accepted / verified if verified else math.nan,
        "accepted_per_drafted": accepted / drafted if drafted else math.nan,
        "tokens_per_step": tokens / steps if steps else math.nan,
    }


def combine_rounds(phases: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per figure, the median, min and max over the rounds' summaries (the keys all share)."""
    keys = [k for k in phases[0] if all(k in p for p in phases)] if phases else []
    out = {}
    for key in keys:
        values = [float(p[key]) for p in phases if not math.isnan(float(p[key]))]
        out[key] = {
            "median": statistics.median(values) if values else math.nan,
            "min": min(values, default=math.nan),
            "max": max(values, default=math.nan),
        }
    return out
