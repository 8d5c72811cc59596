"""Versions cut from a PS (dynemb/publish/publisher.py): a full version and the deltas after it,
replayed, are the PS's rows at the last cut, bit for bit, deletions included; on the embedded
store and Redis, on one PS and on two."""

from __future__ import annotations

import time

import numpy as np
import pytest
from published import replay, same

from dynemb.ps_server.client import PSClient
from dynemb.publish.publisher import PublishConfig, publish_table
from dynemb.publish.version import chain

DIM, STATE = 4, 2


def ps_rows(client: PSClient, table: str) -> dict[int, np.ndarray]:
    """The PS's rows now, embedding part: id -> row."""
    out = {}
    for ids, rows in client.export(table):
        for i, row in zip(ids.tolist(), rows[:, :DIM]):
            out[i] = row
    return out


def push(client: PSClient, table: str, ids: np.ndarray, rng) -> None:
    client.push(table, ids, rng.standard_normal((len(ids), DIM + STATE)).astype(np.float32))


@pytest.fixture(params=["embedded", "disk", "redis", "two-ps"])
def client(request, make_ps, redis_namespace, tmp_path):
    if request.param == "disk":
        addresses = [make_ps("--backend", f"disk://{tmp_path}/disk").address]
    elif request.param == "redis":
        url = request.getfixturevalue("redis_url")
        addresses = [make_ps("--backend", url, "--namespace", redis_namespace).address]
    elif request.param == "two-ps":
        addresses = [make_ps().address, make_ps().address]
    else:
        addresses = [make_ps().address]
    with PSClient(addresses, timeout=60) as c:
        yield c


def test_a_full_version_and_its_deltas_replay_to_the_ps_rows(client, tmp_path):
    rng = np.random.default_rng(0)
    client.create_table("user", dim=DIM, state_width=STATE)
    push(client, "user", np.arange(1000, dtype=np.int64), rng)
    config = PublishConfig(tmp_path, full_every=100, rows_per_file=256)
    v1 = publish_table(client, "user", config, step=10)
    assert (v1.number, v1.kind, v1.rows, v1.step, v1.dtype) == (1, "full", 1000, 10, "fp32")
    assert client.describe_table("user").change_log > 0  # the first publish turned it on
    assert same(replay(tmp_path, "user"), ps_rows(client, "user"))

    # between versions: rows changed (some twice), new ones, deletions, one deleted and pushed again
    push(client, "user", np.array([5, 6, 7, 5], dtype=np.int64), rng)
    push(client, "user", np.arange(5000, 5010, dtype=np.int64), rng)
    client.delete("user", np.array([8, 9, 10, 6, 123456], dtype=np.int64))
    push(client, "user", np.array([9], dtype=np.int64), rng)
    v2 = publish_table(client, "user", config, step=20)
    assert (v2.kind, v2.parent, v2.base) == ("delta", 1, 1)
    assert v2.rows == 2 + 1 + 10  # 5, 7; 9; 5000-5009
    # 123456 was never stored: a store may log it as asked (Redis) or not (embedded)
    assert {6, 8, 10} <= set(v2.deleted_ids().tolist()) <= {6, 8, 10, 123456}
    assert same(replay(tmp_path, "user"), ps_rows(client, "user"))

    # nothing changed: an empty delta
    v3 = publish_table(client, "user", config)
    assert (v3.kind, v3.rows, v3.deleted) == ("delta", 0, 0)

    # a table cleared, then a few rows back: every old id is a tombstone
    client.import_rows(client.schema("user"), [], replace=True)
    push(client, "user", np.array([1, 2], dtype=np.int64), rng)
    v4 = publish_table(client, "user", config)
    assert v4.kind == "delta" and v4.rows == 2
    assert same(replay(tmp_path, "user"), ps_rows(client, "user"))

    # dropped and made again: the logs cannot say what changed, so a full version
    client.drop_table("user")
    client.create_table("user", dim=DIM, state_width=STATE, change_log=1 << 16)
    push(client, "user", np.array([77], dtype=np.int64), rng)
    v5 = publish_table(client, "user", config)
    assert v5.kind == "full" and "dropped" in v5.source["full_because"]
    assert same(replay(tmp_path, "user"), ps_rows(client, "user"))
    assert [v.number for v in chain(tmp_path, "user")] == [5]
    # and made again without a change log: the publish turns it on, and cuts a full version
    client.drop_table("user")
    client.create_table("user", dim=DIM, state_width=STATE)
    v6 = publish_table(client, "user", config)
    assert v6.kind == "full" and "no change log" in v6.source["full_because"] and v6.rows == 0
    v7 = publish_table(client, "user", config)
    assert v7.kind == "delta"


def test_a_full_version_every_k_and_quantized_rows(embedded_client, tmp_path):
    client = embedded_client
    rng = np.random.default_rng(1)
    client.create_table("item", dim=DIM, state_width=STATE)
    push(client, "item", np.arange(100, dtype=np.int64), rng)
    config = PublishConfig(tmp_path, dtype="int8", full_every=3)
    kinds = []
    for k in range(7):
        push(client, "item", np.arange(10 * k, 10 * k + 5, dtype=np.int64), rng)
        kinds.append(publish_table(client, "item", config).kind)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    held = replay(tmp_path, "item")
    want = ps_rows(client, "item")
    assert held.keys() == want.keys()
    for i, row in want.items():  # int8: each value within half a step of the row's scale
        assert np.abs(held[i] - row).max() <= np.abs(row).max() / 127 / 2 + 1e-7
    # another dtype cannot continue the chain: a full version
    v = publish_table(client, "item", PublishConfig(tmp_path, full_every=3))
    assert v.kind == "full" and v.dtype == "fp32"


def test_a_publisher_fallen_behind_its_change_log_cuts_a_full_version(embedded_client, tmp_path):
    client = embedded_client
    rng = np.random.default_rng(2)
    client.create_table("fast", dim=DIM, state_width=STATE)
    config = PublishConfig(tmp_path, change_log=4096)
    assert publish_table(client, "fast", config).kind == "full"
    assert client.describe_table("fast").change_log == 4096
    for lo in range(0, 10000, 1000):  # more ids than the log keeps
        push(client, "fast", np.arange(lo, lo + 1000, dtype=np.int64), rng)
    v = publish_table(client, "fast", config)
    assert v.kind == "full" and "trimmed" in v.source["full_because"] and v.rows == 10000
    push(client, "fast", np.arange(5, dtype=np.int64), rng)
    assert publish_table(client, "fast", config).kind == "delta"
    assert same(replay(tmp_path, "fast"), ps_rows(client, "fast"))


@pytest.mark.parametrize("backend", ["embedded", "disk", "redis"])
def test_rows_that_expire_between_versions_are_tombstones(make_ps, tmp_path, request, backend):
    from dynemb.ps_server.lifecycle import Lifecycle

    flags: tuple[str, ...] = ()
    if backend == "disk":
        flags = ("--backend", f"disk://{tmp_path}/disk")
    elif backend == "redis":
        url, namespace = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_namespace")
        flags = ("--backend", url, "--namespace", namespace)
    ps = make_ps("--sweep-every", "0.5", *flags)
    rng = np.random.default_rng(3)
    with PSClient(ps.address, timeout=30) as client:
        client.create_table("exp", dim=DIM, state_width=STATE, lifecycle=Lifecycle(ttl_s=4))
        ids = np.arange(200, dtype=np.int64)
        push(client, "exp", ids, rng)
        config = PublishConfig(tmp_path)
        assert publish_table(client, "exp", config).rows == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # rows 0-49 kept in use, the others left to expire
            client.touch("exp", ids[:50])
            if client.describe_table("exp").num_rows == 50:
                break
            time.sleep(0.5)
        push(client, "exp", ids[:5], rng)
        v = publish_table(client, "exp", config)
        assert v.kind == "delta" and v.rows == 5 and sorted(v.deleted_ids().tolist()) == list(range(50, 200))
        assert same(replay(tmp_path, "exp"), ps_rows(client, "exp")) and len(replay(tmp_path, "exp")) == 50
