"""bench/own_model_bench.py runs end to end (a few steps, over a Redis PS too) and its runs agree:
the dynamic tables' losses equal the full tables' (the bench prints the gap)."""

from __future__ import annotations

import re
import sys

import pytest
from helpers import REPO

pytestmark = [pytest.mark.torchrec, pytest.mark.usefixtures("one_process_group", "redis_binaries")]


@pytest.mark.slow
def test_the_own_model_bench_runs_and_its_runs_agree(capsys):
    sys.path.insert(0, str(REPO / "bench"))
    import own_model_bench

    assert own_model_bench.main(["--steps", "4", "--warmup", "1", "--universe", "2000", "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^  (full|embedded|redis PS) .* losses within (\S+) of full$", out, re.M)
    assert [name for name, _ in rows] == ["full", "embedded", "redis PS"], out
    assert all(float(gap) == 0.0 for _, gap in rows), out
    assert "trainer CPU" in out and "beside the redis PS run" in out
