"""A small byte-counting progress bar on stderr (rate and ETA), so conversions of a 1.5 TB
checkpoint say where they are without a tqdm dependency.

On a terminal it redraws one line (at most 5 times a second); otherwise (CI logs, pipes) it
prints a plain line at every 10% so logs stay short.
"""

from __future__ import annotations

import sys
import time


def _size(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
    n /= 1024
  return f"{n:.1f} TiB"


def _duration(s: float) -> str:
  s = int(s)
  return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
  def __init__(self, total: int, label: str, stream=None, enabled: bool = True):
    self.total, self.label, self.done = max(total, 1), label, 0
    self.stream = stream or sys.stderr
    self.enabled = enabled
    self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
    self.start = self._last = time.monotonic()
    self._decile = 0

  def update(self, nbytes: int) -> None:
    self.done += nbytes
    if not self.enabled:
      return
    now = time.monotonic()
    if self.tty and now - self._last >= 0.2:
      self._last = now
      self.stream.write("\r" + self.line(now))
      self.stream.flush()
    elif not self.tty and self.done * 10 // self.total > self._decile:
      self._decile = self.done * 10 // self.total
      self.stream.write(self.line(now) + "\n")

  def line(self, now: float | None = None) -> str:
    elapsed = (now or time.monotonic()) - self.start
    rate = self.done / elapsed if elapsed > 0 else 0.0
    eta = (self.total - self.done) / rate if rate > 0 else 0.0
    pct = 100 * self.done / self.total
    width = 24
    bar = "#" * int(width * self.done / self.total)
    return (f"{self.label} [{bar:<{width}}] {pct:5.1f}% {_size(self.done)}/{_size(self.total)} "
            f"{_size(rate)}/s ETA {_duration(eta)}")

  def close(self) -> None:
    if self.enabled and self.tty:
      self.stream.write("\r" + self.line() + "\n")
      self.stream.flush()
