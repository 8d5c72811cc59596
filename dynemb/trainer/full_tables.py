"""The data side of full (non-dynamic, `--no-dynamic`) tables.

A full table has a fixed number of rows (`--capacity`, else `--universe`), and TorchRec looks an ID up as a row
number: an ID outside [0, rows) is not an error there (FBGEMM logs "Out of bounds ... Setting idx
to zero" and trains row 0). IDs of file data are signed 64-bit hashes, so a full table maps
them into its rows with the hashing trick, as TorchRec's Criteo examples do: row = id mod rows
(non-negative for negative IDs too); IDs that collide share a row. Synthetic IDs are already
< the universe, and stay as they are.

- hash_into_rows: a batch's KJT with every ID mapped into its table's rows;
- check_in_rows: the error, naming table, ID and rows, for an ID that still falls outside;
- same_batch_count: ranks that agree on the number of batches. A rank with one more batch than
  another (a file whose lines do not split evenly) drops it with a warning: a collective step
  that only some ranks take would wait forever.
- full_batches: all of it, over the batches of one split; job_batches: the same for a job's
  TrainConfig (train.py's batches()).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from dynemb.tables import Batch, KeyedJaggedTensor, collective_device
from dynemb.trainer.config import TrainConfig, table_name
from dynemb.trainer.data import feature_names
from dynemb.trainer.schemas import table_rows_total

log = logging.getLogger("dynemb.trainer")


class IDOutOfRange(ValueError):
    """An ID outside its full table's rows (TorchRec would look row 0 up in its place)."""


def _rows_per_value(kjt: KeyedJaggedTensor, rows: Mapping[str, int]) -> torch.Tensor:
    per_key = torch.tensor([rows[k] for k in kjt.keys()], dtype=torch.int64, device=kjt.values().device)
    return per_key.repeat_interleave(torch.tensor(kjt.length_per_key(), device=per_key.device))


def hash_into_rows(kjt: KeyedJaggedTensor, rows: int | Mapping[str, int]) -> KeyedJaggedTensor:
    """The KJT with every ID v of feature f replaced by v mod rows[f] (in [0, rows[f]), also for
    negative v): the hashing trick. `rows`: one row count for every feature, or one per feature
    name. IDs already in range are unchanged."""
    values = kjt.values()
    # numpy's mod by one Python int is ~5x torch.remainder's speed on CPU (a batch's 13k IDs: 50 us)
    if values.device.type == "cpu" and (isinstance(rows, int) or len(set(rows.values())) == 1):
        n = rows if isinstance(rows, int) else next(iter(rows.values()))
        mapped = torch.from_numpy(np.mod(values.numpy(), int(n)))
    elif isinstance(rows, int):
        mapped = torch.remainder(values, rows)
    else:
        mapped = torch.remainder(values, _rows_per_value(kjt, rows))
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=mapped,
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths(),
        offsets=kjt.offsets(),
        stride=kjt.stride(),
        length_per_key=kjt.length_per_key(),
        offset_per_key=kjt.offset_per_key(),
    )


def check_in_rows(
    kjt: KeyedJaggedTensor, rows: int | Mapping[str, int], tables: Mapping[str, str] | None = None
) -> None:
    """Raise IDOutOfRange, naming the table (tables: feature -> table name), the ID and the row
    count, for the first feature with an ID outside [0, rows). One min and max over the batch
    (then per feature, to name the one that is out)."""
    values = kjt.values()
    if values.numel() == 0:
        return
    fewest = rows if isinstance(rows, int) else min(rows[k] for k in kjt.keys())
    if int(values.min()) >= 0 and int(values.max()) < fewest:
        return
    for key, part in zip(kjt.keys(), values.split(kjt.length_per_key())):
        if part.numel() == 0:
            continue
        n = rows if isinstance(rows, int) else rows[key]
        lo, hi = int(part.min()), int(part.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            table = (tables or {}).get(key, key)
            raise IDOutOfRange(
                f"ID {bad} of feature {key} is outside table {table}'s {n:,} rows [0, {n:,}) "
                f"(a full table looks IDs up as row numbers; TorchRec would read row 0 instead)"
            )


def same_batch_count(
    data: Iterable[Batch], what: str = "batches", group: dist.ProcessGroup | None = None
) -> Iterator[Batch]:
    """Collective: `data`, as long as every rank has a next batch (an all_reduce MIN of "I have
    one" per batch). A rank with batches left when another has none drops them with a warning
    that counts them (`data` must be finite: the rest is read to count it): the ranks stop
    together, where a step that only some ranks take would wait forever for the others."""
    return _agreed(iter(data), lambda b: b, what, group)


def _agreed(it: Iterator[Batch], prepare, what: str, group: dist.ProcessGroup | None) -> Iterator[Batch]:
    """`prepare` of each batch of `it` while every rank has one. A batch that `prepare` refuses
    (IDOutOfRange) stops every rank: that rank raises its error, the others one that points to it."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    while True:
        batch, error = next(it, None), None
        if batch is not None:
            try:
                batch = prepare(batch)
            except IDOutOfRange as e:
                error = e
        if world == 1:
            if error is not None:
                raise error
            if batch is None:
                return
            yield batch
            continue
        # MIN over ranks: 1 every rank has a batch, 0 one has none, -1 - r rank r's is refused
        status = torch.tensor(
            [-1 - rank if error is not None else int(batch is not None)],
            dtype=torch.int64,
            device=collective_device(group),
        )
        dist.all_reduce(status, op=dist.ReduceOp.MIN, group=group)
        agreed = int(status.item())
        if agreed < 0:
            if error is not None:
                raise error
            raise IDOutOfRange(f"rank {-1 - agreed} found an ID outside its full table (see that rank's error)")
        if agreed == 0:
            if batch is not None:
                n_batches, n_samples = 1, len(batch.labels)
                for rest in it:
                    n_batches, n_samples = n_batches + 1, n_samples + len(rest.labels)
                log.warning(
                    "rank %d had %d more %s than another rank (%d sample%s): dropped, not %s "
                    "(the data does not split evenly across the ranks, and they stop together)",
                    rank,
                    n_batches,
                    what if n_batches > 1 else what.removesuffix("es"),
                    n_samples,
                    "s" if n_samples != 1 else "",
                    "trained on" if "train" in what else "used",
                )
            return
        yield batch


def describe(cfg: TrainConfig) -> str:
    """The job's first log line on the full-table path."""
    rows = table_rows(cfg)[0].values()
    lo, hi = min(rows), max(rows)
    if lo == hi:
        return f"full tables: {lo:,} rows each, IDs mapped by id mod {lo:,} (hashing trick; {_SET_BY})"
    return f"full tables: {lo:,} to {hi:,} rows, IDs mapped by id mod the table's rows (hashing trick; {_SET_BY})"


_SET_BY = "rows: --capacity, else --universe, else a count of the file's distinct IDs"


def full_batches(
    data: Iterable[Batch],
    rows: int | Mapping[str, int],
    tables: Mapping[str, str] | None = None,
    even: bool = False,
    what: str = "batches",
) -> Iterator[Batch]:
    """The batches of one split for full tables: IDs hashed into each table's rows and checked
    there, and with `even` (file data: ranks may hold different numbers of lines) the same
    number of batches on every rank (collective; see same_batch_count)."""

    fewest = rows if isinstance(rows, int) else min(rows.values(), default=0)

    def prepare(batch: Batch) -> Batch:
        values = batch.sparse_features.values()
        if values.numel() == 0 or (int(values.min()) >= 0 and int(values.max()) < fewest):
            return batch  # every ID is a row of its table already (synthetic data): nothing to map
        kjt = hash_into_rows(batch.sparse_features, rows)
        check_in_rows(kjt, rows, tables)
        return Batch(dense_features=batch.dense_features, sparse_features=kjt, labels=batch.labels)

    if not even:
        return map(prepare, data)
    return _agreed(iter(data), prepare, what, None)


def table_rows(cfg: TrainConfig) -> tuple[dict[str, int], dict[str, str]]:
    """Per feature, the rows of its full table and that table's name, as model.build() makes them."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = {f: table_name(i) for i, f in enumerate(feature_names(cfg.data.num_sparse))}
    return {f: table_rows_total(cfg, world, t) for f, t in names.items()}, names


def job_batches(cfg: TrainConfig, data: Iterable[Batch], split: int) -> Iterator[Batch]:
    """A job's batches of one split (0: training, 1: held out) for its full tables. With file
    data, ranks agree on the number of batches (collective); synthetic batches come in the same
    number on every rank already."""
    rows, tables = table_rows(cfg)
    what = "training batches" if split == 0 else "held-out batches"
    return full_batches(data, rows, tables, even=cfg.data.source != "synthetic", what=what)
