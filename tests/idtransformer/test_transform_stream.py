"""TransformStream (dynemb/idtransformer/stream.py): a stream of sharded transforms with one exchange
per batch gives what transform_tables gives batch by batch, with real torchrun ranks; a rank
that runs out first ends the stream for all; a refused batch is raised on every rank."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from helpers import TESTS, torchrun

WORKER = TESTS / "dist" / "transform_stream_worker.py"
sys.path.insert(0, str(WORKER.parent))

import transform_stream_worker as worker  # noqa: E402


@pytest.mark.dist
@pytest.mark.parametrize("world,policy", [(2, "hybrid"), (4, "lru")])
def test_a_stream_agrees_with_transform_tables_on_every_rank(world, policy):
    run = torchrun(world, WORKER, policy, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for rank in range(world):
        assert f"OK rank {rank} of {world}" in run.stdout


@pytest.fixture
def one_rank():
    from dynemb.trainer.train import init_distributed

    created = init_distributed()
    yield
    if created:
        dist.destroy_process_group()


@pytest.mark.torchrec
def test_on_one_rank_the_message_goes_to_the_rank_itself(one_rank):
    worker.same_as_transform_tables(0, 1, "hybrid")
    worker.a_refused_batch(0, 1)


@pytest.mark.torchrec
def test_the_protocol_is_kept(one_rank):
    from dynemb.idtransformer.stream import TransformStream

    ts = worker.tables(2, 100, "lru")
    stream = TransformStream(ts)
    with pytest.raises(ValueError, match="sizes must give the 2 tables' blocks of the 3 IDs"):
        stream.exchange(torch.arange(3), [1, 1])
    stream.exchange(torch.arange(3), [1, 2])
    assert stream.exchange(None) is None and stream.received is not None
    with pytest.raises(RuntimeError, match="transform_received"):
        stream.exchange(None)
    stream.transform_received()
    with pytest.raises(RuntimeError, match="nothing was received"):
        stream.transform_received()
    tag, slots, results = stream.exchange(None)
    assert tag is None and slots.tolist() == [0, 0, 1] and [r.slots.numel() for r in results] == [1, 2]
    assert not stream.open
    with pytest.raises(RuntimeError, match="this transform stream is over"):
        stream.exchange(None)
    with pytest.raises(ValueError, match="at least one table"):
        TransformStream([])
