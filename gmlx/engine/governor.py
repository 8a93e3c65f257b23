"""The memory governor: bands from measured headroom, and what each band allows.

    green   plenty of headroom: everything runs
    yellow  getting tight: still admitting, but capacity planning counts one free slot
    orange  new prefills wait (running requests keep decoding)
    red     the largest running request is shed so the rest survive

Bands are measured from the free working set (``capacity.free_bytes``) against a
floor. Moving to a worse band is immediate; moving back needs the headroom to clear
the better band's threshold by a margin (hysteresis), so the band does not flap
around a threshold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from gmlx.engine.errors import ServerOverloadedError


class Band(StrEnum):
    GREEN = "green"
    YELLOW = "yellow"
    ORANGE = "orange"
    RED = "red"


ORDER = (Band.GREEN, Band.YELLOW, Band.ORANGE, Band.RED)


class ShedError(ServerOverloadedError):
    """A running request was ended to keep the server within memory."""

    openai_type = "server_overloaded_shed"
    anthropic_type = "overloaded_error"  # Anthropic's own name, as for a full queue
    code = "server_overloaded_shed"


class Governor:
    """Measures headroom at most every ``interval_s`` and keeps the band.

    Args:
        probe: returns the free working set in bytes (injectable for tests).
        floor_bytes: headroom below this is red; orange below 2x, yellow below 4x.
        hysteresis: fraction of the floor the headroom must clear to improve a band.
        enabled: a disabled governor reports no band and never restricts anything.
    """

    def __init__(
        self,
        probe: Callable[[], int],
        *,
        floor_bytes: int,
        hysteresis: float = 0.25,
        interval_s: float = 0.1,
        shed_cooldown_s: float = 1.0,
        enabled: bool = True,
    ) -> None:
        self.probe = probe
        self.floor_bytes = max(1, floor_bytes)
        self.hysteresis = hysteresis
        self.interval_s = interval_s
        self.shed_cooldown_s = shed_cooldown_s
        self.enabled = enabled
        self.band = Band.GREEN
        self.headroom_bytes: int | None = None
        self.sheds = 0
        self.band_changes = 0
        self.entered = dict.fromkeys((b.value for b in ORDER), 0)
        self._measured_at = 0.0
        self._last_shed = 0.0
        self._lock = threading.Lock()

    def thresholds(self) -> dict[Band, int]:
        """Headroom at or above which each band holds (red holds below orange's)."""
        f = self.floor_bytes
        return {Band.GREEN: 4 * f, Band.YELLOW: 2 * f, Band.ORANGE: f, Band.RED: 0}

    def _band_for(self, headroom: int) -> Band:
        limits = self.thresholds()
        target = next(b for b in ORDER if headroom >= limits[b])
        if ORDER.index(target) < ORDER.index(self.band):
            # Improving: each step up must clear its threshold by the margin.
            margin = int(self.hysteresis * self.floor_bytes)
            target = next(b for b in ORDER if headroom >= limits[b] + (margin if b != Band.RED else 0))
            if ORDER.index(target) > ORDER.index(self.band):
                target = self.band
        return target

    def update(self, force: bool = False) -> Band:
        """Measure (if due) and return the current band."""
        if not self.enabled:
            return Band.GREEN
        now = time.monotonic()
        with self._lock:
            if not force and now - self._measured_at < self.interval_s:
                return self.band
            self._measured_at = now
            headroom = int(self.probe())
            self.headroom_bytes = headroom
            band = self._band_for(headroom)
            if band != self.band:
                self.band = band
                self.band_changes += 1
                self.entered[band.value] += 1
            return self.band

    @property
    def admits_prefill(self) -> bool:
        return not self.enabled or self.band in (Band.GREEN, Band.YELLOW)

    def claim_shed(self) -> bool:
        """True when the caller should shed its largest request now (once per cooldown)."""
        if not self.enabled or self.band is not Band.RED:
            return False
        now = time.monotonic()
        with self._lock:
            if now - self._last_shed < self.shed_cooldown_s:
                return False
            self._last_shed = now
            self.sheds += 1
            self._measured_at = 0.0  # measure again right after the memory is freed
            return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "band": self.band.value if self.enabled else None,
            "headroom_bytes": self.headroom_bytes,
            "floor_bytes": self.floor_bytes,
            "sheds": self.sheds,
            "band_changes": self.band_changes,
            "entered": dict(self.entered),
            "admission_paused": not self.admits_prefill,
        }


def default_floor(total_bytes: int) -> int:
    """The floor: 5% of memory, at least 512 MiB and at most 4 GiB."""
    return min(4 * 1024**3, max(512 * 1024**2, total_bytes // 20))
