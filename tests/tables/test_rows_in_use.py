"""A PS table whose rows expire never deletes the rows a job holds on its devices: the job
touches them (dynemb/tables/touch.py), however long they stay resident. A real PS process,
sweeping every half second, and the public API in front of an own model."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import wait_until
from tables_models import CONFIGS, FEATURES, UNIVERSE, build, train_step
from torchrec import KeyedJaggedTensor

from dynemb import tables as dt
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.lifecycle import Lifecycle

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

CAPACITY = 60
HOT = np.arange(5)  # in every batch: resident all along, never evicted
TTL = 4


@pytest.fixture(autouse=True)
def one_process_group():
    created = dt.init_distributed("cpu")
    yield
    if created:
        dist.destroy_process_group()


def batch(rng: np.random.Generator, cold: int = 12):
    """Both features: the hot IDs and `cold` others drawn from the rest of the universe."""
    values, lengths = [], []
    for _ in FEATURES:
        ids = np.concatenate([HOT, rng.integers(len(HOT), UNIVERSE, cold)])
        values.append(ids)
        lengths += [len(HOT), cold]  # two bags a feature
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES, values=torch.from_numpy(np.concatenate(values)), lengths=torch.tensor(lengths)
    )
    return kjt, torch.tensor([1.0, 0.0])


def test_rows_resident_for_longer_than_the_ttl_are_never_deleted(make_ps):
    ps = make_ps("--sweep-every", "0.5")
    configs = [dataclasses.replace(c, lifecycle=Lifecycle(ttl_s=TTL)) for c in CONFIGS]
    rng = np.random.default_rng(0)
    model, dense = build(CAPACITY)
    with dt.DynamicEmbeddings(model, configs, store=ps.address) as dyn:  # the hot rows reach the PS at close
        for kjt, y in dyn.wrap(batch(rng) for _ in range(3)):
            train_step(model, dense, kjt, y)
    model, dense = build(CAPACITY)
    with PSClient(ps.address, timeout=30) as client:
        assert client.describe_table("user").lifecycle.ttl_s == TTL  # the configs set it
        start = client.read_deletions("user").cursor
        with dt.DynamicEmbeddings(model, configs, store=ps.address, start="warm") as dyn:
            began = time.monotonic()

            def endless():
                while time.monotonic() - began < 3.5 * TTL:  # the hot rows resident for 3.5 TTLs
                    yield batch(rng)
                    time.sleep(0.02)

            for kjt, y in dyn.wrap(endless()):
                train_step(model, dense, kjt, y)
            gone = client.read_deletions("user", start).ids
            # cold rows evicted early in the run expired meanwhile: the sweeps ran
            assert len(gone) > 0, "nothing was swept: the test shows nothing"
            assert not np.isin(HOT, gone).any(), f"resident rows deleted: {sorted(set(HOT) & set(gone.tolist()))}"
            assert (dyn.tables.toucher.touched["user"]) >= len(HOT)
        got = client.pull("user", HOT)
        assert not got.missing.any()


def test_a_table_config_with_a_lifecycle_out_of_range_is_refused():
    from dynemb.ps_server.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="ttl 1 s is out of range"):
        dt.TableConfig("user", lifecycle=Lifecycle(ttl_s=1))


def test_cold_rows_come_back_as_new_after_they_expired(make_ps):
    """A row evicted to the PS and not used for its TTL is swept; the ID seen again starts from
    the table's initializer (it is new to the PS)."""
    ps = make_ps("--sweep-every", "0.5")
    configs = [dataclasses.replace(c, lifecycle=Lifecycle(ttl_s=TTL)) for c in CONFIGS]
    model, dense = build(CAPACITY)
    rng = np.random.default_rng(1)
    with dt.DynamicEmbeddings(model, configs, store=ps.address) as dyn:
        for kjt, y in dyn.wrap(batch(rng) for _ in range(3)):
            train_step(model, dense, kjt, y)
    with PSClient(ps.address, timeout=30) as client:
        stored = client.describe_table("user").num_rows
        assert stored > len(HOT)
        wait_until(lambda: client.describe_table("user").num_rows == 0, timeout=30, interval=0.5, what="expiry")
        assert len(set(client.read_deletions("user").ids.tolist())) == stored
        assert client.pull("user", np.arange(UNIVERSE)).missing.all()
