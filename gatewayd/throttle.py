"""Throttling of refused logins: failures counted per key (an account, a client address) in a window.

Past ``limit`` failures a key is refused without a look at the password or secret until its window
ends, so a flood costs the gateway a dictionary lookup. The table is bounded (least recently used
keys are forgotten first), so attacker-chosen keys cannot grow it without end. Pure state, no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

CAPACITY = 100_000  # keys remembered at most


@dataclass(slots=True)
class _Window:
    started: float
    failures: int = 0
    blocked: bool = False


class Throttle:
    """Failures per key in a fixed window of ``window`` seconds; ``limit`` 0 turns it off."""

    def __init__(self, limit: int, window: float, capacity: int = CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window = window
        self.capacity = capacity
        self.clock = clock
        self._keys: OrderedDict[str, _Window] = OrderedDict()

    def _current(self, key: str, now: float) -> _Window | None:
        entry = self._keys.get(key)
        if entry is not None and now - entry.started >= self.window:
            del self._keys[key]
            return None
        return entry

    def retry_after(self, *keys: str) -> float:
        """Seconds until every key may try again (0: go ahead)."""
        if not self.limit:
            return 0.0
        now = self.clock()
        wait = 0.0
        for key in keys:
            entry = self._current(key, now)
            if entry is not None and entry.blocked:
                wait = max(wait, entry.started + self.window - now)
        return wait

    def failed(self, *keys: str) -> list[str]:
        """Count a refusal against each key; the keys that are blocked from now on (to audit once)."""
        if not self.limit:
            return []
        now = self.clock()
        newly = []
        for key in keys:
            entry = self._current(key, now)
            if entry is None:
                entry = self._keys[key] = _Window(now)
                while len(self._keys) > self.capacity:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            entry.failures += 1
            if not entry.blocked and entry.failures >= self.limit:
                entry.blocked = True
                newly.append(key)
        return newly

    def succeeded(self, key: str) -> None:
        """A right password: that account's failures are forgotten (its address's are not)."""
        self._keys.pop(key, None)
