"""A generation's text, token by token, ended before its first stop string.

The entry emits a block of tokens per decode step (accepted drafts plus one token of the
target), so a stop string can end in the middle of a block, or start in one block and end in
the next. The text is therefore judged one token at a time, as an engine without speculation
would: after each token the text so far is searched, and the first token that completes a stop
string ends the generation (its usage counts up to that token, never the rest of the block);
the text returned ends right before the stop string. While streaming, the longest end of the
text that could still begin a stop string is held back, so no released text is taken back.

Each piece of text keeps the origin of its token (an accepted draft or the target's own), so a
client can show which text the draft model wrote.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Text of one token (or the part of it released so far), and where the token came from."""

    text: str
    draft: bool  # an accepted draft token; False: the target's correction or bonus token


class StopText:
    """Text added token by token; released up to a possible stop string, cut before a stop."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = stops
        self.stopped = False  # a stop string was found: nothing more is added
        self._held: list[Piece] = []
        self._held_text = ""

    def add(self, text: str, draft: bool) -> bool:
        """Add the text of the next token; True once a stop string is complete (the text
        is then cut right before it)."""
        if self.stopped:
            raise RuntimeError("StopText.add after a stop string ended the text")
        if not text:
            return False
        self._held.append(Piece(text, draft))
        self._held_text += text
        found = [i for i in (self._held_text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self._keep(min(found))
            self.stopped = True
        return self.stopped

    def release(self) -> list[Piece]:
        """The pieces that can no longer become part of a stop string (all of them once
        stopped)."""
        hold = 0 if self.stopped else self._possible_start()
        return self._take(len(self._held_text) - hold)

    def flush(self) -> list[Piece]:
        """Everything held (the generation ended without a stop string)."""
        return self._take(len(self._held_text))

    def _possible_start(self) -> int:
        """Length of the longest end of the held text that begins some stop string."""
        text = self._held_text
        for length in range(min(len(text), max(map(len, self.stops), default=1) - 1), 0, -1):
            end = text[-length:]
            if any(stop.startswith(end) for stop in self.stops):
                return length
        return 0

    def _keep(self, count: int) -> None:
        """Keep only the first `count` characters of the held text."""
        kept, remaining = [], count
        for piece in self._held:
            if remaining <= 0:
                break
            kept.append(Piece(piece.text[:remaining], piece.draft))
            remaining -= len(piece.text)
        self._held, self._held_text = kept, self._held_text[:count]

    def _take(self, count: int) -> list[Piece]:
        """Remove and return the first `count` characters of the held text, as pieces."""
        taken: list[Piece] = []
        while count > 0 and self._held:
            piece = self._held[0]
            if len(piece.text) <= count:
                taken.append(self._held.pop(0))
                count -= len(piece.text)
            else:
                taken.append(Piece(piece.text[:count], piece.draft))
                self._held[0] = Piece(piece.text[count:], piece.draft)
                count = 0
        released = sum(len(piece.text) for piece in taken)
        self._held_text = self._held_text[released:]
        return taken
