"""`dynemb ps plan` (dynemb/ps_server/sizing.py): its figures, its errors, and docs/scale.md's
worked examples, which must equal what the command prints.

After changing a constant or the output, regenerate the examples:
    PYTHONPATH=. .venv/bin/python tests/ps_server/test_scale_doc.py
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from dynemb.cli import main
from dynemb.ps_server import sizing
from dynemb.ps_server.schema import OPTIMIZERS

DOC = Path(__file__).resolve().parents[2] / "docs" / "scale.md"  # also run as a script: no helpers
# a fenced example: the command on its `$ ` line, then what it prints
EXAMPLE = re.compile(r"```console\n\$ (dynemb ps plan [^\n]*)\n(.*?)```", re.S)
BASE = ["ps", "plan", "--rows", "1e9", "--dim", "64", "--optimizer", "adam"]
RATE = ["--samples-per-s", "1e6", "--ids-per-sample", "40", "--hit-rate", "0.9"]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def printed(command: str) -> str:
    code, out, err = run(shlex.split(command)[1:])
    assert code == 0, err
    return out


def test_the_docs_examples_are_what_the_command_prints():
    examples = EXAMPLE.findall(DOC.read_text())
    assert len(examples) >= 4
    for command, shown in examples:
        assert shown == printed(command), f"docs/scale.md is stale for `{command}`: run {__file__}"


def test_the_worked_examples_cover_1e9_and_1e10_rows_at_dim_64_and_128():
    commands = [shlex.split(command) for command, _ in EXAMPLE.findall(DOC.read_text())]
    seen = {(c[c.index("--rows") + 1], c[c.index("--dim") + 1]) for c in commands}
    assert {("1e9", "64"), ("1e9", "128"), ("1e10", "64"), ("1e10", "128")} <= seen


def test_the_figures_follow_from_the_inputs():
    p = sizing.plan(10**10, 64, "adam", 1e6, 40, 0.9, utilisation=0.5, redis_gib_per_master=32, replicas=1)
    assert p.state_width == 128 and p.row_bytes == 768
    assert p.pulls_per_s == p.pushes_per_s == 4e6  # misses: 1e6 x 40 x (1 - 0.9)
    assert p.redis_bytes == math.ceil(10**10 * p.redis_bytes_per_row)
    assert p.redis_bytes_per_row / (p.row_bytes + 8) <= 1.2  # listpack buckets: the layout by default
    assert p.masters_for_memory == -(-p.redis_bytes // (32 * 2**30))
    assert p.ps_processes == -(-8e6 // (0.5 * sizing.PS_ROWS_PER_SECOND))
    assert p.masters == max(3, p.masters_for_memory, p.masters_for_rate)
    # twice the rate needs twice the processes; a perfect hit rate needs one, and 3 masters for little data
    assert sizing.plan(10**10, 64, "adam", 2e6, 40, 0.9).ps_processes == pytest.approx(2 * p.ps_processes, abs=1)
    small = sizing.plan(1000, 8, "sgd", 1e6, 40, 1.0)
    assert small.ps_processes == 1 and small.masters == 3 and small.rows_per_s == 0


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_state_width_is_the_trainers(optimizer):
    from dynemb.trainer.config import TrainConfig
    from dynemb.trainer.model import ps_schema  # the schema the trainer creates its PS tables with

    cfg = TrainConfig()
    cfg.optimizer = optimizer
    cfg.table.dim = 32
    schema = ps_schema(cfg, 0)
    p = sizing.plan(10**6, 32, optimizer, 1e5, 10, 0.5)
    assert (p.state_width, p.row_bytes) == (schema.state_width, schema.row_bytes)


def test_jemalloc_size_classes():
    got = [sizing._jemalloc_size_class(n) for n in (1, 9, 128, 129, 516, 640, 641, 772, 1540, 2049)]
    assert got == [8, 16, 128, 160, 640, 640, 768, 896, 1792, 2560]


@pytest.mark.slow
def test_redis_bytes_per_row_match_a_real_redis(redis_process, redis_namespace):
    """The memory model against a real redis-server (Redis's own config) filled through
    RedisStore as a PS does by default: a table declaring its rows, listpack buckets of ~16
    rows (the store raising hash-max-listpack-value), and rows over 16 KiB in hashtables."""
    from dynemb.ps_server.backends.redis_store import RedisStore
    from dynemb.ps_server.schema import TableSchema

    proc = redis_process()
    client = proc.client()
    for width, n in ((16, 200_000), (192, 50_000), (5000, 2_000)):  # rows of 64 B, 768 B and 20,000 B
        client.flushall()
        before = client.info("memory")["used_memory"]
        store = RedisStore.from_url(proc.url, namespace=redis_namespace)
        store.create_table(TableSchema("t", dim=width, expected_rows=n))
        ids = np.random.default_rng(width).integers(1, 1 << 62, n)
        for lo in range(0, n, 1000):
            store.push("t", ids[lo : lo + 1000], np.ones((len(ids[lo : lo + 1000]), width), np.float32))
        per_row = (client.info("memory")["used_memory"] - before) / n
        encoding = client.object("encoding", store._meta("t").key(0))
        store.close()
        assert encoding == (b"listpack" if 4 * width <= 16384 else b"hashtable")
        model = sizing.redis_bytes_per_row(4 * width)
        assert per_row == pytest.approx(model, rel=0.03 if encoding == b"listpack" else 0.06), (width, per_row, model)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--rows", "1.5"], "argument --rows: '1.5' is not a whole number"),
        (["--rows", "ten"], "argument --rows: 'ten' is not a number"),
        (["--rows", "0"], "rows (--rows) must be a whole number >= 1, got 0"),
        (["--hit-rate", "1.2"], "hit rate (--hit-rate) must be from 0 to 1"),
        (["--hit-rate", "-0.1"], "hit rate (--hit-rate) must be from 0 to 1"),
        (["--samples-per-s", "0"], "samples/s (--samples-per-s) must be > 0"),
        (["--samples-per-s", "inf"], "argument --samples-per-s: 'inf' is not a finite number"),
        (["--dim", "30000"], "(adam: dim <= 21845); got 30000"),
        (["--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb'"),
        (["--utilisation", "1.5"], "utilisation (--utilisation) must be > 0 and <= 1"),
        (["--replicas", "-1"], "replicas (--replicas) must be a whole number >= 0"),
        (["--redis-gib-per-master", "0"], "GiB per Redis master (--redis-gib-per-master) must be > 0"),
    ],
)
def test_bad_values_get_an_error_naming_the_flag_and_the_limit(flags, says):
    code, out, err = run(BASE + RATE + flags)
    assert code != 0 and out == "" and says in err


def test_a_missing_flag_is_named():
    code, _, err = run(BASE)
    assert code == 2 and "--samples-per-s" in err and "required" in err


def test_json_output_has_the_same_figures():
    code, out, _ = run([*BASE, *RATE, "--json"])
    d = json.loads(out)
    p = sizing.plan(10**9, 64, "adam", 1e6, 40, 0.9)
    assert code == 0 and d["masters"] == p.masters and d["ps_processes"] == p.ps_processes
    assert d["rows_per_s"] == 8e6 and d["redis_bytes"] == p.redis_bytes


def test_rows_written_in_full_stay_exact():
    code, out, _ = run(
        ["ps", "plan", "--rows", "1_000_000_000_001", "--dim", "8", "--optimizer", "sgd", *RATE, "--json"]
    )
    assert code == 0 and json.loads(out)["rows"] == 1_000_000_000_001


def test_help_lists_every_flag_and_points_to_the_doc():
    code, out, _ = run(["ps", "plan", "--help"])
    assert code == 0 and "docs/scale.md" in out and "dynemb ps plan --rows 1e10" in out
    for flag in ("--rows", "--dim", "--optimizer", "--samples-per-s", "--ids-per-sample", "--hit-rate", "--replicas"):
        assert flag in out
    assert "size Redis and the PS processes" in run(["ps", "--help"])[1]


def _regenerate() -> None:
    text = DOC.read_text()
    DOC.write_text(EXAMPLE.sub(lambda m: f"```console\n$ {m.group(1)}\n{printed(m.group(1))}```", text))


if __name__ == "__main__":
    _regenerate()
    sys.exit(0)
