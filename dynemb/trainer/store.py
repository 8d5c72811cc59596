"""Where the job's rows live: a client of the PS at --ps, or the embedded store in each rank."""

from __future__ import annotations

from dynemb import tables as dt
from dynemb.trainer.config import TrainConfig


def open_row_store(cfg: TrainConfig) -> dt.RowStore:
    """A client of the PS at --ps (retrying per the job's timeouts), or the embedded store in
    this process (per rank under torchrun: each keeps its own IDs' rows)."""
    return dt.open_store(
        cfg.ps or None,
        timeout=cfg.ps_timeout_seconds,
        attempt_timeout=cfg.ps_attempt_seconds,
        tls_ca=cfg.ps_tls_ca or None,
        tls_cert=cfg.ps_tls_cert or None,
        tls_key=cfg.ps_tls_key or None,
    )
