"""A checkpoint's exports (one call per table) make one line in the PS's log, not one a table."""

from __future__ import annotations

import logging
import time

import numpy as np
from helpers import wait_until

from dynemb.ps_server.burst_log import BurstLog


def test_a_burst_of_calls_is_one_line_once_they_stop(caplog):
    burst = BurstLog("exported", quiet_seconds=0.3)
    with caplog.at_level(logging.INFO, logger="dynemb.ps"):
        for t in range(26):
            burst.add(f"dynemb_t_{t}", 1000)
            time.sleep(0.01)
        assert not caplog.records  # still in the burst
        wait_until(lambda: caplog.records, timeout=5)
        time.sleep(0.5)
        burst.add("dynemb_t_0", 5)  # the next burst
        burst.close()  # logged now, not after quiet_seconds
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("exported 26 tables (26,000 rows) in ")
    assert lines[0].endswith("s: dynemb_t_0, dynemb_t_1, dynemb_t_2 and 23 more")
    assert lines[1].startswith("exported 1 table (5 rows)") and lines[1].endswith(": dynemb_t_0")


def test_the_ps_logs_a_checkpoints_exports_in_one_line(tmp_path):
    from dynemb.ps_server.client import PSClient
    from dynemb.ps_server.schema import TableSchema
    from dynemb.testing.local_ps import LocalPS

    log_path = tmp_path / "ps.log"
    with LocalPS(log_path=str(log_path)) as ps, PSClient([ps.address]) as client:
        for t in range(6):
            client.create_table_from_schema(TableSchema(f"burst_{t}", dim=4))
            client.push(f"burst_{t}", np.arange(10), np.ones((10, 4), np.float32))
        for t in range(6):
            list(client.export(f"burst_{t}"))
        wait_until(lambda: "exported 6 tables" in log_path.read_text(), timeout=15)
    text = log_path.read_text()
    assert text.count("exported") == 1, text
    assert "exported 6 tables (60 rows)" in text
