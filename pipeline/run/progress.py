"""Progress for long work that reads well both in a terminal and in a log file.

On a TTY: a tqdm bar (count, rate, ETA, and extra figures such as tokens/s). Elsewhere
(a pod's log, CI): one plain line every `log_every_s` seconds and a last line at the end,
never carriage-return spam. Only counts; it refuses to know what is being counted. Work done
by an earlier attempt is counted too (`resumed`): a resumed bar reads
`25,857/200,000 (21,504 resumed)`, and its rate and ETA are of this attempt's work only.

    with Progress(total=1000, desc="host 0 generate", unit="sample", resumed=200) as bar:
        bar.update(8, tokens=1024)

Where the count's total is not known before the end (tokenize: prompts in files), the share of the
input read so far gives the ETA: `bar.read(0.25)` -> `tokenize: 12,000 prompts, ..., 25% of the
input read, ETA 30s`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm import tqdm


def _columns(file: Any) -> int:
    try:
        return os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not a terminal after all
        return 0


class Progress:
    def __init__(self, total: int | None, desc: str, unit: str, log_every_s: float = 30.0,
                 file: Any = None, resumed: int = 0):
        self.total, self.desc, self.unit, self.resumed = total, desc, unit, resumed
        self.file = file or sys.stderr
        self.count = resumed
        self.extra: dict[str, float] = {}
        self.share: float | None = None
        """The share of the input read (`read`), where `total` is not known."""
        self.started = time.monotonic()
        self.last_log = self.started
        self.log_every_s = log_every_s
        # A terminal that says it is 0 columns wide (some containers' pseudo-terminals) gets no bar
        # from tqdm at all: plain lines there.
        is_tty = hasattr(self.file, "isatty") and self.file.isatty() and _columns(self.file) > 0
        label = f"{desc} ({resumed:,} resumed)" if resumed else desc
        self.bar = (tqdm(total=total, initial=resumed, desc=label, unit=unit, file=self.file, dynamic_ncols=True)
                    if is_tty else None)

    def update(self, n: int = 1, **extra: float) -> None:
        self.count += n
        for key, value in extra.items():
            self.extra[key] = self.extra.get(key, 0) + value
        if self.bar is not None:
            self.bar.update(n)
            if self.extra or self.share:
                self.bar.set_postfix_str(self._extras(), refresh=False)
        elif time.monotonic() - self.last_log >= self.log_every_s:
            self._log()

    def read(self, share: float) -> None:
        """How much of the input (0 to 1) the work has read: its ETA where `total` is not known."""
        self.share = min(max(share, 0.0), 1.0)
        if self.bar is not None:
            self.bar.set_postfix_str(self._extras(), refresh=False)

    def _extras(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        parts = [f"{k} {v:,.0f} ({v / elapsed:,.1f}/s)" for k, v in self.extra.items()]
        if self.total is None and self.share:
            eta = f", ETA {elapsed * (1 - self.share) / self.share:,.0f}s" if self.share < 1 else ""
            parts.append(f"{self.share:.0%} of the input read{eta}")
        return ", ".join(parts)

    def _log(self) -> None:
        self.last_log = time.monotonic()
        elapsed = self.last_log - self.started
        rate = (self.count - self.resumed) / elapsed if elapsed > 0 else 0.0
        total = f"/{self.total:,}" if self.total else ""
        resumed = f" ({self.resumed:,} resumed)" if self.resumed else ""
        eta = f", ETA {(self.total - self.count) / rate:,.0f}s" if self.total and rate > 0 else ""
        extras = f", {self._extras()}" if self.extra or self.share else ""
        print(f"{self.desc}: {self.count:,}{total} {self.unit}s{resumed}, {rate:,.1f}/s{extras}{eta}",
              file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self._log()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
