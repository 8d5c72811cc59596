"""The public API on one process: DynamicEmbeddings in front of an own model trains exactly like
full tables, pushes every row when it ends (exceptions and Ctrl-C included), looks up held-out
batches without a change to the model, refuses a rerun over old rows, and names set-up mistakes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tables_models import CONFIGS, TABLES, UNIVERSE, batches, build, full_rows, train_step
from torchrec import KeyedJaggedTensor

from dynemb import tables as dt
from dynemb.tables.row_store import LocalRowStore

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

CAPACITY = 60  # rows per dynamic table: far fewer than the IDs the batches touch


@pytest.fixture(autouse=True)
def one_process_group(request):
    """A group of one process: NCCL for a case on "cuda", else gloo."""
    case = getattr(request.node, "callspec", None)
    created = dt.init_distributed(case.params.get("device", "cpu") if case else "cpu")
    yield
    if created:
        dist.destroy_process_group()


def train_full(steps: int, device: str = "cpu") -> tuple[list[float], dict[str, np.ndarray], torch.nn.Module]:
    model, dense = build(UNIVERSE, device=device)
    losses = [train_step(model, dense, kjt, y, device) for kjt, y in batches(steps)]
    return losses, full_rows(model), model


def pulled(store: LocalRowStore, table: str) -> np.ndarray:
    return store.pull(table, np.arange(UNIVERSE))


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # cuda: skipped without a GPU (conftest)
def test_trains_exactly_like_full_tables_and_pushes_every_row_at_the_end(device):
    """On the GPU, FBGEMM may sum a row's gradients in another order: within 1e-5 there."""
    tol = dict(rtol=0, atol=1e-6) if device == "cpu" else dict(rtol=1e-5, atol=1e-6)
    full_losses, full, _ = train_full(40, device)
    model, dense = build(CAPACITY, device=device)
    store = LocalRowStore()
    with dt.DynamicEmbeddings(model, CONFIGS, store=store) as dyn:
        losses = [train_step(model, dense, kjt, y, device) for kjt, y in dyn.wrap(batches(40))]
        assert dyn.resident_rows() > 0
    np.testing.assert_allclose(losses, full_losses, **tol)
    for table in TABLES:
        assert store.store.num_rows(table) > 2 * CAPACITY  # rows went to the store and came back
        np.testing.assert_allclose(pulled(store, table), full[table], **tol, err_msg=table)


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_an_exception_in_the_loop_still_pushes_every_resident_row(interrupt):
    _, full, _ = train_full(10)
    model, dense = build(CAPACITY)
    store = LocalRowStore()
    with pytest.raises(interrupt):
        with dt.DynamicEmbeddings(model, CONFIGS, store=store) as dyn:
            for step, (kjt, y) in enumerate(dyn.wrap(batches(40))):
                if step == 10:
                    raise interrupt("stopped")
                train_step(model, dense, kjt, y)
    assert dyn.closed
    for table in TABLES:
        np.testing.assert_allclose(pulled(store, table), full[table], rtol=0, atol=1e-6, err_msg=table)


def test_without_close_the_rows_stay_behind_and_the_process_says_so():
    script = (
        "import sys; sys.path.insert(0, 'tests/tables'); from dynemb import tables as dt; "
        "from tables_models import CONFIGS, batches, build, train_step; dt.init_distributed(); "
        "model, dense = build(60); dyn = dt.DynamicEmbeddings(model, CONFIGS); "
        "[train_step(model, dense, kjt, y) for kjt, y in dyn.wrap(batches(5))]"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "were never closed" in done.stderr and "did not reach the embedded store" in done.stderr
    assert "close()" in done.stderr


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_looking_up_held_out_batches_matches_full_tables_and_changes_nothing(device):
    _, _, full_model = train_full(30, device)
    model, dense = build(CAPACITY, device=device)
    store = LocalRowStore()
    with dt.DynamicEmbeddings(model, CONFIGS, store=store) as dyn:
        for kjt, y in dyn.wrap(batches(30)):
            train_step(model, dense, kjt, y, device)
        dyn.flush()
        before = {t: pulled(store, t) for t in TABLES}
        resident = {n: t.local.slot_id.clone() for n, t in dyn.tables.transformers.items()}
        held_out = list(batches(8, seed=99))  # IDs resident, evicted and never seen
        with torch.no_grad():
            got = [model(kjt.to(device)) for kjt, _ in dyn.wrap(iter(held_out), train=False)]
            want = [full_model(kjt.to(device)) for kjt, _ in held_out]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        for n, t in dyn.tables.transformers.items():
            assert torch.equal(t.local.slot_id, resident[n])
        # training goes on exactly after a look-up: the slots lent are given back their rows
        for kjt, y in dyn.wrap(batches(3, seed=7)):
            train_step(model, dense, kjt, y, device)
    for t in TABLES:
        changed = np.flatnonzero((pulled(store, t) != before[t]).any(1))
        assert len(changed) > 0  # the training after it moved rows
    with torch.no_grad():
        looked_later = store.pull("user", np.arange(3))
    assert looked_later.shape == (3, 4 + 1)


def test_a_rerun_over_old_rows_is_refused_unless_told_what_to_do():
    store = LocalRowStore()
    model, dense = build(CAPACITY)
    with dt.DynamicEmbeddings(model, CONFIGS, store=store) as dyn:
        for kjt, y in dyn.wrap(batches(5)):
            train_step(model, dense, kjt, y)
    rows = store.store.num_rows("user")
    model, dense = build(CAPACITY)
    with pytest.raises(dt.StartRefused, match=r'already holds .* rows .*start="warm".*start="fresh"'):
        dt.DynamicEmbeddings(model, CONFIGS, store=store)
    with dt.DynamicEmbeddings(model, CONFIGS, store=store, start="warm"):
        assert store.store.num_rows("user") == rows
    with dt.DynamicEmbeddings(model, CONFIGS, store=store, start="fresh"):
        assert store.store.num_rows("user") == 0
    other = [dt.TableConfig("user", initializer=dt.Initializer("zeros")), CONFIGS[1]]
    store.push("user", np.arange(3), np.ones((3, 5), np.float32))
    with pytest.raises(dt.StartRefused, match="another schema .*initializer"):
        dt.DynamicEmbeddings(model, other, store=store, start="warm")


def test_set_up_mistakes_name_the_fix():
    from tables_models import Tiny

    with pytest.raises(dt.SetupError, match=r"not a DistributedModelParallel: shard it first with .*shard_model"):
        dt.DynamicEmbeddings(Tiny(CAPACITY), CONFIGS)
    model, _ = build(CAPACITY)
    with pytest.raises(dt.SetupError, match=r"no table 'users'; its tables: user, item"):
        dt.DynamicEmbeddings(model, [dt.TableConfig("users")])
    with pytest.raises(
        dt.SetupError, match=r"table user: TableConfig.capacity is 1,000 but the model's table has 60 rows"
    ):
        dt.DynamicEmbeddings(model, [dt.TableConfig("user", capacity=1000)])
    with pytest.raises(dt.SetupError, match="given twice"):
        dt.DynamicEmbeddings(model, [CONFIGS[0], CONFIGS[0]])
    with pytest.raises(ValueError, match="policy 'fifo' is not one of lru, lfu, hybrid"):
        dt.TableConfig("user", policy="fifo")
    with pytest.raises(ValueError, match="start must be one of"):
        dt.DynamicEmbeddings(model, CONFIGS, start="again")
    # a plan of TorchRec's own choosing (table-wise) for a table made dynamic
    from tables_models import Tiny as T
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    plain = T(CAPACITY)
    apply_optimizer_in_backward(RowWiseAdagrad, plain.ebc.parameters(), {"lr": 0.1})
    table_wise = DistributedModelParallel(plain, device=torch.device("cpu"))
    wrong = r"table user is sharded data_parallel with the dense kernel; dynamic tables need row_wise and fused"
    with pytest.raises(dt.SetupError, match=wrong):
        dt.DynamicEmbeddings(table_wise, CONFIGS)


def test_more_set_up_mistakes_are_one_line_from_dynemb():
    """What an own model met (issue 45): a constraint that would override a dynamic table's
    sharding or kernel, a batch without a feature of a dynamic table."""
    from tables_models import Tiny
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    def tiny():
        m = Tiny(CAPACITY)
        apply_optimizer_in_backward(RowWiseAdagrad, m.ebc.parameters(), {"lr": 0.1})
        return m

    for asked in (ParameterConstraints(compute_kernels=["dense"]), ParameterConstraints(sharding_types=["table_wise"])):
        with pytest.raises(dt.SetupError, match=r"other_constraints\['user'\] asks for .* user is a dynamic table"):
            dt.shard_model(tiny(), CONFIGS, other_constraints={"user": asked})
    kept = ParameterConstraints(compute_kernels=["fused", "dense"], pooling_factors=[3.0])  # allows fused: merged
    dt.shard_model(tiny(), CONFIGS, other_constraints={"user": kept})
    model, _ = build(CAPACITY)
    with dt.DynamicEmbeddings(model, CONFIGS, table_prefix="mistakes_") as dyn:
        only_user = KeyedJaggedTensor.from_lengths_sync(["user_id"], torch.tensor([1, 2]), torch.tensor([1, 1]))
        with pytest.raises(dt.SetupError, match=r"no feature 'item_id' \(of dynamic table item\); its keys: user_id"):
            next(dyn.wrap([only_user]))


@pytest.mark.parametrize(
    "shape",
    ["kjt", "tuple", "dict", "namedtuple", "dataclass"],
)
def test_any_batch_that_holds_one_kjt_comes_back_as_it_came(shape):
    from collections import namedtuple
    from dataclasses import dataclass

    @dataclass
    class Mine:
        labels: torch.Tensor
        features: KeyedJaggedTensor

    Pair = namedtuple("Pair", "labels features")
    model, dense = build(CAPACITY)
    with dt.DynamicEmbeddings(model, CONFIGS) as dyn:
        for kjt, _ in dyn.wrap(batches(1)):
            want = kjt.values()
        for kjt, y in batches(1):
            wrap = {
                "kjt": lambda: kjt,
                "tuple": lambda: (y, kjt),
                "dict": lambda: {"labels": y, "features": kjt},
                "namedtuple": lambda: Pair(y, kjt),
                "dataclass": lambda: Mine(y, kjt),
            }[shape]
            got = next(dyn.wrap([wrap()]))
        assert type(got) is type(wrap())
        over = {"kjt": lambda: got, "tuple": lambda: got[1], "dict": lambda: got["features"]}.get(
            shape, lambda: got.features
        )()
        assert torch.equal(over.values(), want)
        with pytest.raises(TypeError, match="holds no KeyedJaggedTensor"):
            next(dyn.wrap([(y, y)]))
        with pytest.raises(TypeError, match="holds 2 KeyedJaggedTensors"):
            next(dyn.wrap([(kjt, kjt)]))
