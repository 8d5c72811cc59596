"""Eviction policies: which resident IDs leave first when the table is full.

Every policy turns per-slot state into one int64 score; the slots with the LOWEST scores
are evicted first (a batch at a time: `evict_fraction` of the table). Per slot the table
keeps `last_access` (the step, i.e. transform call, that last saw the ID) and `freq` (a
logarithmic counter in [0, 255]).

- LRU:    score = last_access. The longest-idle ID goes first.
- LFU:    score = freq * 2^40 + last_access. The least frequent goes first; among equals the
          longest idle. freq grows logarithmically (below), so a handful of hits does not
          pin an ID for ever, but it never decays: an ID that was hot once stays.
- hybrid: like LFU, with freq decayed by idle time first, as Redis's LFU does:
          decayed = max(freq - idle_steps // decay_steps, 0), applied when scoring and stored
          when the ID is seen again. A once-hot ID that went cold loses a point every
          `decay_steps` idle steps and is eventually evicted.
- TTL (with any of them): an ID idle for more than `ttl_steps` scores below every live one
  (the most idle first), so expired IDs are evicted before any other.

The log counter (Redis's LFU counter): a new ID starts at `initial_freq`; each batch that
sees it increments it with probability 1 / ((freq - initial_freq) * log_factor + 1),
so reaching 255 takes about log_factor * 10^6 hits at log_factor 10.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POLICIES = ("lru", "lfu", "hybrid")
MAX_FREQ = 255
_FREQ_SHIFT = 40  # last_access (a step count) stays below 2^40


@dataclass(frozen=True)
class EvictionPolicy:
    """Which slots a full table frees, and how many (see the module doc); checked when made."""

    kind: str = "hybrid"
    evict_fraction: float = 0.05  # share of the table freed when it is full
    ttl_steps: int | None = None  # idle longer than this: evicted first
    log_factor: float = 10.0  # LFU/hybrid: how slowly freq grows
    initial_freq: int = 5  # LFU/hybrid: freq of a newly admitted ID (Redis: LFU_INIT_VAL)
    decay_steps: int = 100  # hybrid: idle steps per point of decay

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"eviction policy {self.kind!r} is not one of {POLICIES}")
        if not 0 < self.evict_fraction <= 1:
            raise ValueError(f"evict_fraction must be in (0, 1], got {self.evict_fraction}")
        if self.ttl_steps is not None and self.ttl_steps < 1:
            raise ValueError(f"ttl_steps must be >= 1 (or None for no TTL), got {self.ttl_steps}")
        if self.log_factor < 0:
            raise ValueError(f"log_factor must be >= 0, got {self.log_factor}")
        if not 0 <= self.initial_freq <= MAX_FREQ:
            raise ValueError(f"initial_freq must be in [0, {MAX_FREQ}], got {self.initial_freq}")
        if self.decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1, got {self.decay_steps}")

    def scores(self, last_access: torch.Tensor, freq: torch.Tensor, step: int) -> torch.Tensor:
        """int64 eviction score per slot (lowest evicted first); see the module doc.
        last_access: int32 or int64 steps; freq: uint8."""
        last = last_access.to(torch.int64)
        idle = step - last
        if self.kind == "lru":
            score = last.clone()
        else:
            f = freq.to(torch.int64)
            if self.kind == "hybrid":
                f = (f - idle // self.decay_steps).clamp_(min=0)
            score = (f << _FREQ_SHIFT) + last
        if self.ttl_steps is not None:
            expired = idle > self.ttl_steps
            score = torch.where(expired, last - (1 << 62), score)
        return score

    def bump(self, freq: torch.Tensor, hits: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
        """freq after a batch that saw each ID `hits` times: +1 if draw (uniform [0, 1), one
        per ID) < 1 - (1 - p)^hits, p = 1 / ((freq - initial_freq) * log_factor + 1).
        (The CPU kernel flips a coin per sighting instead, as Redis does per access.)"""
        f = freq.to(torch.float64)
        p = 1.0 / ((f - self.initial_freq).clamp(min=0) * self.log_factor + 1.0)
        h = hits.to(torch.float64)
        # (1 - p)^h as the kernel computes it (exactly so for h == 1)
        p_batch = torch.where(h == 1, 1.0 - (1.0 - p), 1.0 - torch.exp(h * torch.log1p(-p)))
        return torch.where((draw < p_batch) & (freq < MAX_FREQ), freq + 1, freq)


DEFAULT_POLICY = EvictionPolicy()
