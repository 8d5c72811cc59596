"""Where the job's rows live: a client of the PS at --ps, or the embedded store in each rank."""

from __future__ import annotations

import os

import torch.distributed as dist

from dynemb import tables as dt
from dynemb.ps_server.client import RetryPolicy
from dynemb.trainer.config import TrainConfig


def open_row_store(cfg: TrainConfig) -> dt.RowStore:
    """A client of the PS at cfg.ps (retrying per the job's timeouts), or the embedded store in
    this process (per rank under torchrun: each keeps its own IDs' rows)."""
    if cfg.ps:
        # every PS call is idempotent, so a PS that is down or hangs is simply tried again, for
        # up to ps_timeout_seconds, each try given ps_attempt_seconds
        retry = RetryPolicy(attempts=None, max_backoff=5.0, attempt_timeout=cfg.ps_attempt_seconds)
        return dt.RemoteRowStore(
            cfg.ps,
            timeout=cfg.ps_timeout_seconds,
            retry=retry,
            auth_token=os.environ.get("DYNEMB_PS_AUTH_TOKEN") or None,
            tls_ca=cfg.ps_tls_ca or None,
            tls_cert=cfg.ps_tls_cert or None,
            tls_key=cfg.ps_tls_key or None,
        )
    return dt.LocalRowStore(per_rank=dist.get_world_size() > 1)
