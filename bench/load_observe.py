"""What bench/ps_load.py watches on the server side: memory over time, and the PS's own error count.

- PS memory: the resident set size of the PS process (psutil), so only for a PS on this machine.
- Redis memory: `used_memory` from INFO memory (what Redis itself has allocated).
- CPU time: the PS process's (psutil) and Redis's (INFO cpu), to show who was busy.
- On a Cluster: Redis memory and CPU summed over its masters.
- PS errors: `dynemb_ps_errors_total` from the PS's /metrics, by status code.

Memory growth is judged on smoothed figures: the median of the samples in the window that
ends where warm-up ends against the median of those in the window that ends the run. A
single sample would swing with the messages in flight at that instant (64 clients with a
0.5 MiB batch each are tens of MiB); a leak moves the median.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

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
