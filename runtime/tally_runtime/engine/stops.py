"""Stop strings over streamed text: never emit a partial match that would later be retracted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class StopMatcher:
    """Feed decoded text; get back the text that is safe to emit and whether a stop matched.

    Text that could still be the start of a stop string is held back until it either completes
    the stop (then it is dropped with everything after it) or cannot anymore.
    """

    stops: Sequence[str]
    _pending: str = field(default="", init=False)
    stopped: bool = field(default=False, init=False)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buffer = self._pending + text
        cut = min((i for i in (buffer.find(s) for s in self.stops if s) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buffer[:cut]
        hold = max((_partial_suffix(buffer, s) for s in self.stops if s), default=0)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """Release held-back text when generation ends without a stop."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0
