"""`dynemb ps plan` (dynemb/ps_server/sizing.py): its figures, its errors, and the worked
examples of docs/scale.md and docs/ps.md, which must equal what the command prints.

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
PS_DOC = DOC.with_name("ps.md")  # its sizing section: one example with the disk tier
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
    """What `command` prints: its output, or for an example of a refusal (an InvalidArgument, exit
    status 1) its error."""
    code, out, err = run(shlex.split(command)[1:])
    assert code == 0 or (code == 1 and out == "" and err.startswith("dynemb: error: ")), err
    return out if code == 0 else err


def test_the_docs_examples_are_what_the_command_prints():
    examples = EXAMPLE.findall(DOC.read_text())
    assert len(examples) >= 4
    for command, shown in examples:
        assert shown == printed(command), f"docs/scale.md is stale for `{command}`: run {__file__}"
    # the one refusal shown on purpose: new IDs a day with neither a TTL nor a cap
    refused = [shlex.split(command) for command, shown in examples if shown.startswith("dynemb: error: ")]
    assert len(refused) == 1 and "--new-ids-per-day" in refused[0]
    assert "--ttl" not in refused[0] and "--max-rows" not in refused[0]
    # docs/ps.md's sizing section shows one, with its disk tier
    (shown_in_ps_doc,) = [shown for command, shown in EXAMPLE.findall(PS_DOC.read_text()) if shown == printed(command)]
    assert "\ndisk tier (" in shown_in_ps_doc and "\npick:           disk: " in shown_in_ps_doc


def test_the_worked_examples_cover_1e9_and_1e10_rows_at_dim_64_and_128():
    commands = [shlex.split(command) for command, _ in EXAMPLE.findall(DOC.read_text())]
    seen = {(c[c.index("--rows") + 1], c[c.index("--dim") + 1]) for c in commands if "--rows" in c}
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
@pytest.mark.torchrec
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
        model = sizing.redis_bytes_per_row(4 * width + sizing.LIFECYCLE_STAMP_BYTES)  # the row and its stamp
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
        (["--disk-tib-per-ps", "0"], "TiB per disk PS (--disk-tib-per-ps) must be > 0, got 0.0"),
        (["--disk-cache-fraction", "0"], "disk cache fraction (--disk-cache-fraction) must be > 0 and <= 1"),
        (["--disk-cache-fraction", "1.5"], "disk cache fraction (--disk-cache-fraction) must be > 0 and <= 1"),
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
    assert d["disk"]["processes"] == p.disk.processes == 64 and d["disk"]["disk_bytes"] == p.disk.disk_bytes
    assert d["disk"]["pick"] == "disk"


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


# -- rows that expire: the steady state of new IDs a day, a TTL and a row cap ---------------------

DAY = 86_400
EXPIRING = ["ps", "plan", "--dim", "64", "--optimizer", "adam", *RATE]


def expiring(rows=None, **kw) -> sizing.Plan:
    return sizing.plan(rows, 64, "adam", 1e6, 40, 0.9, **kw)


def test_the_steady_state_holds_the_new_ids_of_one_ttl():
    p = expiring(new_ids_per_day=1e9, ttl=30 * DAY)
    assert p.rows == p.rows_alive == 30 * 10**9 and p.long_lived_rows == 0
    assert p.days_to_steady == 30 and p.growth_bytes_per_day == 1e9 * p.redis_bytes_per_row
    # the memory figures are those of a table of the steady rows
    fixed = expiring(30 * 10**9)
    for figure in ("redis_bytes", "masters_for_memory", "masters", "rows_per_s", "ps_processes"):
        assert getattr(p, figure) == getattr(fixed, figure), figure  # the rows/s: the training rate's alone
    assert expiring(new_ids_per_day=2.5e6, ttl=DAY / 2).rows == 1_250_000  # 12 h is half a day
    assert expiring(new_ids_per_day=1e9, ttl=60 * DAY).rows == 2 * p.rows


def test_long_lived_rows_add_on_top_and_the_cap_holds_the_table():
    p = expiring(10**8, new_ids_per_day=1e9, ttl=30 * DAY)
    assert p.rows == p.rows_alive == 30_100_000_000 and p.long_lived_rows == 10**8
    capped = expiring(10**8, new_ids_per_day=1e9, ttl=30 * DAY, max_rows=2 * 10**10)
    assert capped.rows == 2 * 10**10 and capped.rows_alive == 30_100_000_000
    assert capped.days_to_steady == pytest.approx(19.9)  # (2e10 - 1e8) / 1e9: the cap comes before the TTL
    assert expiring(10**8, new_ids_per_day=1e9, ttl=30 * DAY, max_rows=10**11).rows == 30_100_000_000
    # a cap with no TTL: the table fills to it and stays
    no_ttl = expiring(new_ids_per_day=1e9, max_rows=2 * 10**10)
    assert no_ttl.rows == 2 * 10**10 and no_ttl.rows_alive is None and no_ttl.days_to_steady == 20
    # rows given without a rate: the cap still holds them; a TTL alone removes none of the rows in use
    assert expiring(10**9, max_rows=5 * 10**8).rows == 5 * 10**8
    assert expiring(10**9, ttl=30 * DAY).rows == 10**9


def test_every_row_carries_its_last_touched_stamp_on_redis():
    p = sizing.plan(10**6, 16, "sgd", 1e5, 10, 0.5)  # 64-byte rows: the stamp's 4 bytes show
    assert p.row_bytes == 64 and p.value_bytes == 64 + sizing.LIFECYCLE_STAMP_BYTES == 68
    assert p.redis_bytes_per_row == sizing.redis_bytes_per_row(68) > sizing.redis_bytes_per_row(64)
    assert p.redis_bytes == math.ceil(10**6 * sizing.redis_bytes_per_row(68))


def test_new_ids_with_neither_a_ttl_nor_a_cap_are_refused_with_the_growth_a_day():
    per_row = expiring(10**9).redis_bytes_per_row
    with pytest.raises(sizing.InvalidArgument) as caught:
        expiring(new_ids_per_day=1e9)
    message = str(caught.value)
    assert "--ttl" in message and "--max-rows" in message and "without end" in message
    assert f"1,000,000,000 rows = {sizing._bytes(1e9 * per_row)} a day" in message
    assert "803.17 GiB a day" in message  # 1e9 x 862 B
    code, out, err = run([*EXPIRING, "--new-ids-per-day", "1e9"])
    assert code == 1 and out == "" and "803.17 GiB a day on the Redis masters" in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([], "give the rows stored (--rows), or the new IDs a day (--new-ids-per-day)"),
        (["--new-ids-per-day", "0", "--ttl", "30d"], "new IDs a day (--new-ids-per-day) must be > 0, got 0.0"),
        (["--new-ids-per-day", "-5", "--ttl", "30d"], "new IDs a day (--new-ids-per-day) must be > 0"),
        (["--new-ids-per-day", "inf", "--ttl", "30d"], "argument --new-ids-per-day: 'inf' is not a finite number"),
        (["--new-ids-per-day", "1e9", "--ttl", "0"], "argument --ttl: a duration must be seconds > 0"),
        (
            ["--new-ids-per-day", "1e9", "--ttl", "30x"],
            "or a number > 0 with s, m, h or d (3600, 90m, 12h, 30d); got '30x'",
        ),
        (["--new-ids-per-day", "1e9", "--max-rows", "0"], "row cap (--max-rows) must be a whole number >= 1, got 0"),
        (["--new-ids-per-day", "1e9", "--max-rows", "1.5"], "argument --max-rows: '1.5' is not a whole number"),
    ],
)
def test_bad_expiry_values_get_an_error_naming_the_flag_and_the_limit(flags, says):
    code, out, err = run(EXPIRING + flags)
    assert code != 0 and out == "" and says in err


def test_plan_refuses_bad_expiry_values_named():
    for kw, says in (
        ({"new_ids_per_day": 1e9, "ttl": 0}, "TTL (--ttl) must be > 0 seconds"),
        ({"new_ids_per_day": 1e9, "ttl": math.nan}, "TTL (--ttl) must be > 0 seconds"),
        ({"new_ids_per_day": math.inf, "ttl": DAY}, "new IDs a day (--new-ids-per-day) must be > 0"),
        ({"new_ids_per_day": 1e9, "max_rows": 2.5}, "row cap (--max-rows) must be a whole number >= 1"),
    ):
        with pytest.raises(sizing.InvalidArgument, match=re.escape(says)):
            expiring(**kw)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("3600", 3600),
        ("1e5", 1e5),
        ("90s", 90),
        ("15m", 900),
        ("12h", 43_200),
        ("30d", 30 * DAY),
        ("1.5d", 1.5 * DAY),
        (" 7 d ", 7 * DAY),
        ("1_000s", 1000),
    ],
)
def test_durations_read_as_seconds(text, seconds):
    assert sizing.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "30x", "30 days", "0", "0d", "-1h", "inf", "nan", "1e400s", "h30", "30M"])
def test_durations_out_of_form_or_not_above_0_are_refused(text):
    with pytest.raises(sizing.InvalidArgument, match=re.escape(f"(3600, 90m, 12h, 30d); got {text!r}")):
        sizing.parse_duration(text)


def test_durations_print_in_the_largest_unit_that_divides_them():
    assert [sizing.format_duration(s) for s in (30 * DAY, 1.5 * DAY, 5400, 90, 1.5)] == [
        "30d",
        "36h",
        "90m",
        "90s",
        "1.5s",
    ]
    for text in ("30d", "36h", "90m", "90s"):
        assert sizing.format_duration(sizing.parse_duration(text)) == text


def test_the_plan_shows_the_steady_rows_and_how_they_were_derived():
    code, out, _ = run([*EXPIRING, "--rows", "1e8", "--new-ids-per-day", "1e9", "--ttl", "30d", "--max-rows", "2e10"])
    text = " ".join(out.split())  # the derivation wraps
    assert code == 0 and out.startswith("model:          20,000,000,000 rows")
    assert "100,000,000 long-lived + 1,000,000,000 new IDs a day x TTL 30 days = 30,100,000,000" in text
    assert "held at the --max-rows cap of 20,000,000,000" in text
    assert "steady after 19.9 days of new IDs, the masters growing 803.17 GiB a day until then" in text
    assert "+ 4 B last-touched stamp" in out
    code, out, _ = run([*EXPIRING, "--new-ids-per-day", "1e9", "--max-rows", "2e10"])
    assert "new IDs a day, no TTL: held at the --max-rows cap" in " ".join(out.split())
    assert "803.17 GiB a day" in " ".join(out.split())
    # no rows line for rows given alone
    assert "\nrows:" not in run([*EXPIRING, "--rows", "1e9"])[1]


def test_the_ttl_flag_is_the_plans_ttl_in_seconds_and_json_says_the_derivation():
    code, out, _ = run([*EXPIRING, "--new-ids-per-day", "1e9", "--ttl", "30d", "--json"])
    d = json.loads(out)
    p = expiring(new_ids_per_day=1e9, ttl=30 * DAY)
    assert code == 0 and d == json.loads(json.dumps(p.as_dict()))
    assert d["rows"] == 30 * 10**9 and d["ttl_s"] == 30 * DAY and d["new_ids_per_day"] == 1e9
    assert d["rows_derivation"] == "1,000,000,000 new IDs a day x TTL 30 days = 30,000,000,000"
    assert d["growth_bytes_per_day"] == 1e9 * d["redis_bytes_per_row"] and d["value_bytes"] == 772


def test_help_names_the_expiry_flags_and_an_example():
    code, out, _ = run(["ps", "plan", "--help"])
    assert code == 0
    text = " ".join(out.split())  # argparse wraps the flags' help
    for flag, says in (
        ("--new-ids-per-day NEW_IDS_PER_DAY", "IDs seen for the first time a day"),
        ("--ttl TTL", "a row neither read nor written this long is deleted: seconds, or a number with s, m, h or d"),
        ("--max-rows MAX_ROWS", "the row cap"),
    ):
        assert f"{flag} {says}" in text
    assert "dynemb ps plan --new-ids-per-day 1e9 --ttl 30d" in out
    assert "min(--max-rows, --rows +" in out


# -- the disk tier: the same rows on disk PSes --------------------------------------------------


def test_the_disk_tier_follows_from_the_measured_constants():
    p = sizing.plan(10**10, 64, "adam", 1e6, 40, 0.9)
    d = p.disk
    # 1.15x the row and its id, as measured (87.3 B for a 68-byte row and its 8-byte id); no stamp
    # on disk for rows that never expire
    assert sizing.DISK_BYTES_PER_RAW_BYTE == pytest.approx(1.149, abs=5e-4)
    assert d.value_bytes == 768 and d.bytes_per_row == pytest.approx(87.3 / 76 * 776) == pytest.approx(891.38, abs=0.01)
    assert d.disk_bytes == math.ceil(10**10 * d.bytes_per_row) and d.rows_per_tb == pytest.approx(
        1e12 / d.bytes_per_row
    )
    # size: 8.11 TiB at 2.5 TiB a disk; rate: 8M rows/s at 0.5 of one PS's cold pulls and pushes, half each
    assert d.processes_for_size == 4 == math.ceil(d.disk_bytes / (2.5 * 2**40))
    assert d.ps_rows_per_s == pytest.approx(2 / (1 / 353_719 + 1 / 194_187)) == pytest.approx(250_728, abs=1)
    assert d.processes_for_rate == 64 == math.ceil(8e6 / (0.5 * d.ps_rows_per_s))
    assert d.processes == 64 and d.processes_at_hot_pulls == math.ceil(8e6 / (0.5 * 2 / (1 / 1_620_053 + 1 / 194_187)))
    # the cache: 0.1 of the rows' bytes, spread over the PSes; a PS's memory adds its index and the rest measured
    assert d.cache_bytes == 768 * 10**9 and d.cache_bytes_per_ps == math.ceil(768 * 10**9 / 64)
    assert d.ps_memory_bytes == math.ceil(d.cache_bytes_per_ps + 16 * 2**20 / 10**7 * 10**10 / 64 + 223 * 2**20)
    assert d.memory_bytes == 64 * d.ps_memory_bytes
    assert d.block_reads_per_s_per_disk == pytest.approx(4e6 / 64 * 0.85)
    # against Redis: masters and replicas hold the rows in RAM, the PS processes beside them
    assert d.redis_memory_bytes == 2 * p.redis_bytes + 68 * sizing.PS_RSS_BYTES
    assert d.redis_processes == 2 * 251 + 68 and d.pick == "disk"


def test_the_disk_tier_scales_with_its_settings_and_stamps_rows_that_expire():
    base = sizing.plan(10**10, 64, "adam", 1e3, 1, 0.9).disk  # a slow rate: the bytes set the PSes
    assert base.processes == base.processes_for_size == 4
    assert sizing.plan(10**10, 64, "adam", 1e3, 1, 0.9, disk_tib_per_ps=0.5).disk.processes == 17  # 8.11 / 0.5
    # a cache of all the rows' bytes (6.98 TiB) needs 7 PSes at the backend's 1 TiB a PS
    whole = sizing.plan(10**10, 64, "adam", 1e3, 1, 0.9, disk_cache_fraction=1.0).disk
    assert whole.processes_for_cache == whole.processes == 7 and whole.cache_bytes == 768 * 10**10
    # a TTL or a cap: the rows carry their 4-byte stamp on disk too
    expiring_rows = sizing.plan(10**10, 64, "adam", 1e3, 1, 0.9, ttl=30 * DAY).disk
    assert expiring_rows.value_bytes == 772 and expiring_rows.bytes_per_row == pytest.approx(87.3 / 76 * 780)


def test_the_disk_tier_is_picked_only_where_it_needs_less_ram_on_no_more_processes(monkeypatch):
    # at the measured rates 64 disk PSes do what 64 masters and 68 PS processes do (no replicas);
    # were a disk PS's pushes 50,000 rows/s, the rate would set 183 of them: Redis
    assert sizing.plan(10**6, 64, "adam", 1e6, 40, 0.9, replicas=0).disk.processes == 64
    monkeypatch.setattr(sizing, "DISK_PS_PUSH_ROWS_PER_SECOND", 50_000)
    by_rate = sizing.plan(10**6, 64, "adam", 1e6, 40, 0.9, replicas=0).disk
    assert by_rate.pick == "redis" and by_rate.redis_processes == 132 and by_rate.processes == 183
    assert by_rate.why.startswith("the rate sets the disk PSes: 183 against the Redis tier's 132 processes")
    monkeypatch.undo()
    # few rows: Redis holds them in less RAM than a disk PS process takes
    small = sizing.plan(1000, 8, "sgd", 10, 1, 0.5).disk
    assert small.pick == "redis" and small.why == "the rows fit in RAM: the disk tier would save no RAM"
    assert small.memory_bytes >= small.redis_memory_bytes


def test_the_plan_prints_the_disk_tier_with_its_measured_point():
    code, out, _ = run([*BASE, *RATE])
    assert code == 0
    tier = out[out.index("\ndisk tier (") :]
    for line in (
        "bytes on disk:  830.16 GiB after compaction",  # 1e9 x 891.38 B
        "disk PSes:      64, each with its own disk (size: 1 at 2.5 TiB a disk; rate: 64 at 125,364 rows/s each)",
        "DRAM cache:     71.53 GiB in all, 1.12 GiB a PS: 0.1 of the rows' bytes (--disk-cache-fraction)",
        "(measured: 0.1 gave a pool hit rate of 0.81 on Zipf(1.05) batches,",
        "other fractions, and the trainers' misses, were not measured",
        "planned at 0.5 of measured capacity: 250,728 rows/s a disk PS",
    ):
        assert line in tier, line
    assert "--disk-tib-per-ps" in run(["ps", "plan", "--help"])[1]


def _regenerate() -> None:
    for doc in (DOC, PS_DOC):
        text = doc.read_text()
        doc.write_text(EXAMPLE.sub(lambda m: f"```console\n$ {m.group(1)}\n{printed(m.group(1))}```", text))


if __name__ == "__main__":
    _regenerate()
    sys.exit(0)
