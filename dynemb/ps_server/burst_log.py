"""One log line for a burst of per-table calls: a trainer's checkpoint exports every table of
its job (26 Export calls for a DLRM), a restore imports them, a job's start creates them. Logged
call by call, that is a screen of lines per checkpoint; BurstLog counts them and logs one line
once no call has come for `quiet_seconds`:

    exported 26 tables (1,302,528 rows) in 1.4 s: dynemb_t_0, dynemb_t_1, dynemb_t_2 and 23 more

prometheus_client already counts every call and row (dynemb_ps_requests_total, _rows_total);
this is the log's summary of them, for an operator reading it.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("dynemb.ps")
NAMES_SHOWN = 3


class BurstLog:
    """Args:
    verb: what the calls did, as the line starts ("exported", "imported", "created").
    quiet_seconds: a burst is over once no call has come for this long.
    """

    def __init__(self, verb: str, quiet_seconds: float = 2.0) -> None:
        self.verb, self.quiet_seconds = verb, quiet_seconds
        self._lock = threading.Lock()
        self._tables: dict[str, int] = {}  # rows per table, in order of the calls
        self._first = self._last = 0.0
        self._timer: threading.Timer | None = None

    def add(self, table: str, rows: int = 0) -> None:
        """One call of the burst: `rows` rows of `table`."""
        with self._lock:
            now = time.monotonic()
            if not self._tables:
                self._first = now
            self._last = now
            self._tables[table] = self._tables.get(table, 0) + rows
            if self._timer is None:
                self._start_timer(self.quiet_seconds)

    def _start_timer(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._flush_when_quiet)
        self._timer.daemon = True  # a PS that stops does not wait for it (close() logs what is left)
        self._timer.start()

    def _flush_when_quiet(self) -> None:
        with self._lock:
            left = self._last + self.quiet_seconds - time.monotonic()
            if left > 0:  # calls came meanwhile: the burst goes on
                self._start_timer(left)
                return
            self._timer = None
            line = self._line()
        log.info("%s", line)

    def _line(self) -> str:
        tables, self._tables = self._tables, {}
        rows = sum(tables.values())
        names = list(tables)
        shown = ", ".join(names[:NAMES_SHOWN])
        if len(names) > NAMES_SHOWN:
            shown += f" and {len(names) - NAMES_SHOWN} more"
        what = f"{len(names)} table{'s' if len(names) != 1 else ''}"
        return f"{self.verb} {what} ({rows:,} rows) in {self._last - self._first:.1f} s: {shown}"

    def close(self) -> None:
        """Log what has come since the last line, now."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            line = self._line() if self._tables else None
        if line:
            log.info("%s", line)
