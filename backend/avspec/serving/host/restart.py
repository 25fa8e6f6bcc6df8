"""When the launcher starts a dead tritonserver again: exponential backoff under a budget.

tritonserver can die on its own (Triton 2.51 aborts after some stub deaths) or be killed. The
launcher restarts it while the front stays up answering 503 with Retry-After. A server that
keeps dying must not restart forever: at most `max_restarts` within any `window_s`; past that
the launcher exits and a service manager (or an operator) takes over. The delay doubles with
each restart still inside the window, from `first_delay_s` up to `max_delay_s`, so a crash loop
does not burn the CPU, while a single crash is served again within seconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartBudget:
    """Restart times within a sliding window, and the delay before the next restart."""

    max_restarts: int = 5
    window_s: float = 600.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    _times: deque[float] = field(default_factory=deque, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("max_restarts must be >= 0 and window_s > 0")
        if not 0 <= self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 <= first_delay_s <= max_delay_s")

    def next_delay(self, now: float) -> float | None:
        """Record a restart at `now` and return how long to wait first; None once the budget
        of the window is spent (nothing recorded then)."""
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return None
        delay = min(self.max_delay_s, self.first_delay_s * 2 ** len(self._times))
        self._times.append(now)
        return delay

    @property
    def used(self) -> int:
        """Restarts recorded in the current window."""
        return len(self._times)
