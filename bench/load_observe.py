"""What bench/ps_load.py watches on the server side: memory over time, and the PS's own error count.

- PS memory: the resident set size of the PS process (psutil), so only for a PS on this machine.
- Redis memory: `used_memory` from INFO memory (what Redis itself has allocated).
- CPU time: the PS process's (psutil) and Redis's (INFO cpu), to show who was busy.
- On a Cluster: Redis memory and CPU summed over its masters.
- PS errors: `dynemb_ps_errors_total` from the PS's /metrics, by status code.
- With --ttl: the table's row count and last sweep (DescribeTable), and the rows the PS's
  sweeps deleted (`dynemb_ps_rows_expired_total`), judged by `steady_size` below.

Memory growth is judged on smoothed figures: the median of the samples in the window that
ends where warm-up ends against the median of those in the window that ends the run. A
single sample would swing with the messages in flight at that instant (64 clients with a
0.5 MiB batch each are tens of MiB); a leak moves the median.

A table whose rows expire, fed new ids at a rate r, settles where rows leave as fast as they
come: at r x (how long a row stays). A row pushed once and never read again stays at least its
TTL, and at most (`Lifetimes.most`) TTL + 1 s (stamps are whole seconds) + the interval between
the sweeper's passes + its wait between looks at the tables + two passes' time (the pass that
started just before the row expired, then the one that deletes it, which may reach it last).
`steady_size` takes the median of the row counts sampled in the last quarter of the run, and
bounds it by the rows pushed in the last TTL seconds (all still stored) and in the last
`most` seconds (plus the pushes in flight): per sample, so that a push rate that varies moves
the bounds with it. A sweeper that cannot keep up makes its passes longer as the table grows,
and the bounds with them: so the counts must also stop growing (their slope over the window,
against the rate of new ids: `kept`) and stay within a band.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

import numpy as np
import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families


class MemorySampler:
    """Samples the PS's RSS and Redis's used_memory; with several Redis URLs (a Cluster's
    masters) the Redis figures, memory and CPU, are their sums."""

    def __init__(self, ps_pid: int | None, redis_url: str | list[str] | None) -> None:
        self.ps = psutil.Process(ps_pid) if ps_pid else None
        urls = [redis_url] if isinstance(redis_url, str) else list(redis_url or [])
        self.nodes = [redis.Redis.from_url(u) for u in urls]
        self.redis = self.nodes[0] if self.nodes else None
        self.times: list[float] = []
        self.ps_rss: list[float] = []
        self.redis_used: list[float] = []

    def redis_used_memory(self) -> int:
        return sum(int(r.info("memory")["used_memory"]) for r in self.nodes)

    def reset(self) -> None:
        self.times.clear()
        self.ps_rss.clear()
        self.redis_used.clear()

    def sample(self, t: float) -> None:
        """Record both figures at run time t (seconds). A PS that has exited raises psutil.NoSuchProcess."""
        self.times.append(t)
        self.ps_rss.append(float(self.ps.memory_info().rss) if self.ps else np.nan)
        self.redis_used.append(float(self.redis_used_memory()) if self.redis else np.nan)

    def cpu_seconds(self) -> dict[str, float | None]:
        """CPU time (user + system) the PS process and the Redis server have used so far."""
        ps = redis_cpu = None
        if self.ps:
            t = self.ps.cpu_times()
            ps = t.user + t.system
        if self.nodes:
            infos = [r.info("cpu") for r in self.nodes]
            redis_cpu = sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos)
        return {"ps": ps, "redis": redis_cpu}

    def close(self) -> None:
        for r in self.nodes:
            r.close()


@dataclass(frozen=True)
class Growth:
    at_warmup_end: float  # bytes, median of the window ending at warm-up's end
    at_end: float  # bytes, median of the window ending the run
    peak: float
    ratio: float  # at_end / at_warmup_end - 1

    def as_json(self) -> dict:
        return {
            "at_warmup_end_bytes": int(self.at_warmup_end),
            "at_end_bytes": int(self.at_end),
            "peak_bytes": int(self.peak),
            "growth": round(self.ratio, 4),
        }


def growth(times, values, warmup_end: float, end: float, window: float) -> Growth:
    """Growth of `values` from the end of warm-up to the end of the run (see the module doc).

    Each window holds the samples in (edge - window, edge]; one that holds none takes the
    single sample nearest before its edge."""
    t, v = np.asarray(times, dtype=float), np.asarray(values, dtype=float)
    if len(t) == 0:
        raise ValueError("no memory samples were taken")

    def median_before(edge: float) -> float:
        inside = (t > edge - window) & (t <= edge)
        if not inside.any():
            before = np.flatnonzero(t <= edge)
            inside = before[-1:] if len(before) else np.array([0])
        return float(np.median(v[inside]))

    start, stop = median_before(warmup_end), median_before(end)
    after = t > warmup_end - window
    peak = float(v[after].max() if after.any() else v.max())
    return Growth(start, stop, peak, stop / start - 1.0)


def ps_error_counts(metrics_url: str) -> dict[str, float]:
    """Errors the PS has counted since it started, by status code, from its /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "dynemb_ps_errors":
            for s in family.samples:
                if s.name == "dynemb_ps_errors_total":
                    counts[s.labels["code"]] = counts.get(s.labels["code"], 0.0) + s.value
    return counts


def ps_rows_expired(metrics_url: str, table: str) -> float:
    """Rows the PS's sweeps have deleted from `table` since it started, from its /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "dynemb_ps_rows_expired":
            for s in family.samples:
                if s.name == "dynemb_ps_rows_expired_total" and s.labels.get("table") == table:
                    return s.value
    return 0.0


@dataclass(frozen=True)
class Lifetimes:
    """How long a row of a table with a TTL stays stored when it is pushed once and never read
    again (seconds; the module doc).

    Attributes:
        ttl: the table's TTL.
        pass_every: the sweeper's interval between passes over the table (sweeper.Sweeper.pass_every).
        poll: the sweeper's wait between looks for tables due (--sweep-every / 4).
        pass_seconds: the longest pass seen.
    """

    ttl: float
    pass_every: float
    poll: float
    pass_seconds: float = 0.0

    @property
    def expected(self) -> float:
        """TTL + the pass interval: what the steady size is compared with (rows x rate)."""
        return self.ttl + self.pass_every

    @property
    def cycle(self) -> float:
        """The longest from one pass's start to the next's: interval + poll + a pass."""
        return self.pass_every + self.poll + self.pass_seconds

    @property
    def most(self) -> float:
        """The longest a row stays: TTL + 1 s of stamp rounding + a cycle + the pass that deletes it."""
        return self.ttl + 1.0 + self.cycle + self.pass_seconds


@dataclass(frozen=True)
class SteadySize:
    """The row counts of the last `tail` of a run against what its pushes of new ids predict.

    Attributes:
        window_from: when the window of samples judged starts (run seconds).
        samples: row counts in it.
        median, low, high: their median, least and most.
        rate: new ids pushed a second, over the window and one `expected` lifetime before it.
        expected: the median over the window of the rows pushed in the last lifetimes.expected s.
        least: the same of the rows pushed in the last TTL seconds: all still stored.
        most: the same of those pushed in the last lifetimes.most seconds, plus the pushes in flight.
        band: the most high / low may be: `band` asked, or (TTL + 1 s + a cycle) / TTL if more:
            the saw-tooth of the passes and of the stamps' whole seconds alone.
        kept: the slope of the counts over the window (least squares) over the rate of new ids
            in it: about 0 for a table that settled, 1 for one that keeps every row.
    """

    window_from: float
    samples: int
    median: float
    low: float
    high: float
    rate: float
    expected: float
    least: float
    most: float
    band: float
    kept: float
    lifetimes: Lifetimes
    failures: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        def rows(x: float) -> int | None:
            return None if np.isnan(x) else int(x)

        return {
            "window_from_s": round(self.window_from, 3),
            "samples": self.samples,
            "steady_rows": rows(self.median),
            "min_rows": rows(self.low),
            "max_rows": rows(self.high),
            "max_over_min": round(self.high / self.low, 4) if self.low > 0 else None,
            "band": round(self.band, 4),
            "kept_share": None if np.isnan(self.kept) else round(self.kept, 4),
            "new_ids_per_s": round(self.rate, 1),
            "expected_rows": rows(self.expected),
            "rate_x_expected_lifetime": int(self.rate * self.lifetimes.expected),
            "bounds_rows": [rows(self.least), rows(self.most)],
            "lifetime_s": {
                "least": self.lifetimes.ttl,
                "expected": round(self.lifetimes.expected, 3),
                "most": round(self.lifetimes.most, 3),
            },
        }


def steady_size(
    times,
    rows,
    pushed,
    end: float,
    lifetimes: Lifetimes,
    in_flight: int = 0,
    band: float = 1.3,
    max_kept: float = 0.5,
    tail: float = 0.25,
) -> SteadySize:
    """Judge a TTL table's row counts (see the module doc): it fails (SteadySize.failures) when
    their median is outside the bounds, they spread over the band, or they still grow by more
    than `max_kept` of the new ids pushed meanwhile.

    Args:
        times: run seconds of the samples (the first at 0, before any push).
        rows: the table's row count at each (None: not read).
        pushed: new ids pushed (calls completed) by each.
        end: the run's length.
        lifetimes: how long rows stay.
        in_flight: most rows written but not yet counted at an instant (clients x batch).
        band: the most the window's largest count may be over its smallest (at least
            (TTL + 1 + a cycle) / TTL).
        max_kept: the most of the window's new ids that its growth may amount to (a table that
            keeps them all: 1; a settled one: 0, give or take the saw-tooth).
        tail: the share of the run at its end whose samples are judged.
    """
    t = np.asarray(times, dtype=float)
    c = np.asarray(pushed, dtype=float)
    n = np.array([np.nan if r is None else float(r) for r in rows])
    start = end * (1 - tail)
    inside = (t >= start) & ~np.isnan(n)
    band = max(band, (lifetimes.ttl + 1.0 + lifetimes.cycle) / lifetimes.ttl)
    if inside.sum() < 2:
        nan = float("nan")
        missing = [f"{int(inside.sum())} row counts were read in the last quarter of the run: too few to judge"]
        return SteadySize(start, int(inside.sum()), nan, nan, nan, 0.0, nan, nan, nan, band, nan, lifetimes, missing)
    ti, w = t[inside], n[inside]

    def within(seconds: float) -> float:
        """The median over the window of the new ids pushed in the `seconds` before each sample."""
        return float(np.median(c[inside] - np.interp(ti - seconds, t, c)))

    lo_at = max(0.0, start - lifetimes.expected)
    rate = (float(np.interp(end, t, c)) - float(np.interp(lo_at, t, c))) / (end - lo_at)
    pushed_in = (c[inside][-1] - c[inside][0]) / (ti[-1] - ti[0])
    kept = float(np.polyfit(ti, w, 1)[0]) / pushed_in if pushed_in > 0 else float("nan")
    s = SteadySize(
        start,
        len(w),
        float(np.median(w)),
        float(w.min()),
        float(w.max()),
        rate,
        within(lifetimes.expected),
        within(lifetimes.ttl),
        within(lifetimes.most) + in_flight,
        band,
        kept,
        lifetimes,
    )
    if s.median < s.least:
        s.failures.append(
            f"the table's steady size {s.median:,.0f} rows is under the {s.least:,.0f} rows pushed in the "
            f"last TTL ({lifetimes.ttl:g} s), which are all stored: rows were lost or miscounted"
        )
    elif s.median > s.most:
        s.failures.append(
            f"the table's steady size {s.median:,.0f} rows is over the {s.most:,.0f} rows pushed in the last "
            f"{lifetimes.most:.1f} s (the longest a row may stay): rows did not expire, or were not deleted"
        )
    if s.low <= 0 or s.high / s.low > band:
        s.failures.append(
            f"the table's size did not settle in the last {end - start:.0f} s of the run: "
            f"{s.low:,.0f} to {s.high:,.0f} rows, over the band of x{band:.2f}"
        )
    if not kept <= max_kept:
        s.failures.append(
            f"the table still grew in the last {end - start:.0f} s of the run, by {kept:.0%} of the new ids "
            f"pushed meanwhile (at most {max_kept:.0%}): the sweeps did not keep up, or rows did not expire"
        )
    return s


class TableWatch:
    """With --ttl: the table's row count and its last sweep, sampled beside memory (DescribeTable
    through the bench's own client), and the new ids the clients had pushed by then."""

    def __init__(self, client, table: str) -> None:
        self.client = client
        self.table = table
        self.times: list[float] = []
        self.rows: list[int | None] = []
        self.pushed: list[int] = []
        self.passes: dict[float, tuple] = {}  # finished -> the LastSweep seen (one per pass)
        self.errors = 0
        self.first_error = ""

    def sample(self, t: float, pushed: int) -> None:
        from dynemb.ps_server.errors import PSError

        try:
            info = self.client.describe_table(self.table, timeout=10)
        except PSError as exc:
            self.errors += 1
            self.first_error = self.first_error or str(exc)
            rows = None
        else:
            rows = info.num_rows
            if info.last_sweep is not None:
                self.passes.setdefault(info.last_sweep.finished, info.last_sweep)
        self.times.append(t)
        self.rows.append(rows)
        self.pushed.append(pushed)

    def series(self, since: float) -> str:
        """The row counts sampled after run second `since`, for a progress line."""
        return " ".join("?" if r is None else f"{r:,}" for t, r in zip(self.times, self.rows) if t > since)

    def pass_figures(self) -> dict:
        """The passes seen (a sample sees the latest only: passes shorter than the sampling
        interval may be missed): their count, seconds and the intervals between their ends."""
        passes = sorted(self.passes.values(), key=lambda p: p.finished)
        seconds = np.array([p.seconds for p in passes])
        gaps = np.diff([p.finished for p in passes])
        return {
            "seen": len(passes),
            "seconds_mean": round(float(seconds.mean()), 3) if len(seconds) else None,
            "seconds_max": round(float(seconds.max()), 3) if len(seconds) else 0.0,
            "interval_median_s": round(float(np.median(gaps)), 3) if len(gaps) else None,
            "scanned_max": max((p.scanned for p in passes), default=0),
            "deleted_max": max((p.deleted for p in passes), default=0),
        }
