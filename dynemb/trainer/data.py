"""Training data as torchrec `Batch`es: dense features, a KeyedJaggedTensor of global IDs, labels.

- SyntheticCriteo: Criteo-shaped (13 dense, 26 sparse features), IDs drawn from a Zipf law
  over a universe per feature (dynemb/trainer/zipf.py: ID k - 1 with probability ~ k^-zipf), and a
  label a model can learn: it depends on the dense features and on a fixed hidden score of
  each ID. Batch k of rank r is a function of (seed, r, k) alone,
  so two runs (or a run and its restart) see the same data.
- criteo_tsv_batches: Criteo-format lines (label, 13 integer, 26 hex categorical columns, tab
  separated, empty = missing); dense x -> log(1 + max(x, 0)), a categorical value -> the
  signed int64 xxh64 of "column:hex". Sample j belongs to rank j % world.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import xxhash
from tqdm import tqdm

from dynemb.common.errors import shown
from dynemb.tables import Batch, KeyedJaggedTensor
from dynemb.trainer.config import DataConfig
from dynemb.trainer.zipf import BoundedZipf

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FEATURE_MIX = np.uint64(0xD1B54A32D192ED03)
log = logging.getLogger("dynemb.train")


class BadLine(ValueError):
    """A malformed line of training data; the message names file, line and problem."""


def feature_names(num_sparse: int) -> list[str]:
    """The KJT keys of the sparse features: cat_0 ... cat_{num_sparse - 1} (feature i's table is
    config.table_name(i))."""
    return [f"cat_{i}" for i in range(num_sparse)]


def _hidden_score(ids: np.ndarray) -> np.ndarray:
    """A fixed value in [-1, 1] per (feature, ID) of key-major ids (features, batch, k): what an
    ID's embedding has to learn. The feature is mixed in so that the few IDs at the head of
    every feature's Zipf draw (the same small numbers) do not all share one score and push
    every label the same way."""
    feature = np.arange(ids.shape[0], dtype=np.uint64).reshape(-1, *([1] * (ids.ndim - 1)))
    with np.errstate(over="ignore"):
        h = ((ids.astype(np.uint64) + np.uint64(1) + feature * _FEATURE_MIX) * _GOLDEN) >> np.uint64(40)
    return (h & np.uint64(0xFFFF)).astype(np.float64) / 32767.5 - 1.0


class SyntheticCriteo:
    """Criteo-shaped batches drawn for one rank (see the module): batch k of rank r depends on
    (data_seed, r, k) alone.

    Args:
        cfg: the data settings (universe, zipf, features, bag size, seed).
        batch_size: samples per batch.
        rank, world_size: whose batches.
    """

    def __init__(self, cfg: DataConfig, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.cfg, self.batch_size, self.rank, self.world_size = cfg, batch_size, rank, world_size
        self.keys = feature_names(cfg.num_sparse)
        rng = np.random.default_rng([cfg.data_seed, 7])
        self.dense_weights = rng.normal(0, 1, cfg.num_dense) / np.sqrt(cfg.num_dense)
        self.draw_ids = BoundedZipf(cfg.zipf, cfg.universe)  # ID k - 1 with probability ~ k^-zipf

    def batch(self, step: int, split: int = 0) -> Batch:
        """Batch `step` of this rank; split 0 trains, 1 evaluates (disjoint random streams)."""
        cfg, b = self.cfg, self.batch_size
        rng = np.random.default_rng([cfg.data_seed, split, self.rank, step])
        dense = rng.lognormal(0.0, 1.0, (b, cfg.num_dense))
        dense = np.log1p(dense).astype(np.float32)
        k = cfg.ids_per_feature
        ids = self.draw_ids(rng, (cfg.num_sparse, b, k)) - 1  # key-major, as a KJT stores them
        logit = (dense - dense.mean()) @ self.dense_weights
        logit = logit + 1.5 * _hidden_score(ids).mean(axis=2).sum(axis=0) / np.sqrt(cfg.num_sparse)
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=torch.from_numpy(ids.reshape(-1).astype(np.int64)),
            lengths=torch.full((cfg.num_sparse * b,), k, dtype=torch.int32),
        )
        return Batch(dense_features=torch.from_numpy(dense), sparse_features=kjt, labels=torch.from_numpy(labels))

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """This rank's training batches from batch `start` on, without end."""
        step = start
        while True:
            yield self.batch(step)
            step += 1

    def eval_batches(self, n: int) -> Iterator[Batch]:
        """This rank's `n` held-out batches (a stream of their own)."""
        for k in range(n):
            yield self.batch(k, split=1)


# -- Criteo TSV ----------------------------------------------------------------------


def held_out_every(cfg: DataConfig) -> int:
    """Every k-th line of a file is held out for evaluation (eval_fraction 1/k); 0: none."""
    return max(1, round(1 / cfg.eval_fraction)) if cfg.eval_fraction > 0 else 0


def tsv_files(source: str) -> list[Path]:
    """The Criteo TSV files of a source: the file, or a folder's *.tsv then *.txt files.

    Raises:
        FileNotFoundError: none there.
    """
    p = Path(source)
    files = sorted(p.glob("*.tsv")) + sorted(p.glob("*.txt")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no Criteo TSV file at {source}")
    return files


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def parse_criteo_line(line: str, num_dense: int = 13, num_sparse: int = 26, where: str = "") -> tuple:
    """(label, dense list, ids list with None for missing). Raises ValueError naming the line."""
    cols = line.rstrip("\n").split("\t")
    if len(cols) != 1 + num_dense + num_sparse:
        raise BadLine(f"{where}: expected {1 + num_dense + num_sparse} tab-separated columns, got {len(cols)}")
    try:
        label = float(cols[0])
    except ValueError:  # its message would quote the whole column
        label = None
    if label not in (0.0, 1.0):
        raise BadLine(f"{where}: label must be 0 or 1, got {shown(cols[0])}")
    try:
        dense = [np.log1p(max(int(c), 0)) if c else 0.0 for c in cols[1 : 1 + num_dense]]
        cats = cols[1 + num_dense :]
        for c in cats:
            if c:
                int(c, 16)  # must be hex
    except ValueError as e:
        raise BadLine(f"{where}: {e}") from None  # int() quotes at most 200 characters
    ids = [_signed(xxhash.xxh64_intdigest(f"{i}:{c}".encode())) if c else None for i, c in enumerate(cats)]
    return label, dense, ids


def criteo_tsv_batches(
    cfg: DataConfig,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    split: int = 0,
    skip_bad_lines: bool | None = None,
) -> Iterator[Batch]:
    """Batches of this rank's lines (split 0: training lines, 1: the held-out ones), once over
    the files. A malformed line raises BadLine naming file and line, or, with skip_bad_lines
    (default: cfg.skip_bad_lines), is logged and skipped, and the count logged at the end."""
    skip = cfg.skip_bad_lines if skip_bad_lines is None else skip_bad_lines
    skipped = 0
    keys = feature_names(cfg.num_sparse)
    every = held_out_every(cfg)
    rows: list[tuple] = []
    sample = 0
    for path in tsv_files(cfg.source):
        # undecodable bytes become U+FFFD, so such a line fails as a malformed line (named) and
        # not as a UnicodeDecodeError of the whole file
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                held_out = every and n % every == 0
                if (split == 1) != bool(held_out):
                    continue
                if sample % world_size == rank:
                    try:
                        rows.append(parse_criteo_line(line, cfg.num_dense, cfg.num_sparse, f"{path}:{n}"))
                    except BadLine as exc:
                        if not skip:
                            raise
                        skipped += 1
                        if skipped <= 20:  # a file of garbage must not flood the log
                            log.warning("skipping a malformed line: %s", exc)
                sample += 1
                if len(rows) == batch_size:
                    yield _tsv_batch(rows, keys)
                    rows = []
    if rows:
        yield _tsv_batch(rows, keys)
    if skipped:
        log.warning("rank %d skipped %d malformed line(s) of %s", rank, skipped, cfg.source)


def file_batches(cfg: DataConfig, batch_size: int, rank: int, world_size: int, split: int) -> Iterator[Batch]:
    """This rank's batches of a file source: training (split 0) passes `cfg.epochs` times over
    the training lines (every line of `source` when there is an `eval_source`); evaluation
    (split 1) once over the held-out lines, or over every line of `eval_source`."""
    if split == 1 and cfg.eval_source:
        held_out = dataclasses.replace(cfg, source=cfg.eval_source, eval_fraction=0.0)
        yield from criteo_tsv_batches(held_out, batch_size, rank, world_size, split=0)
        return
    training = dataclasses.replace(cfg, eval_fraction=0.0) if cfg.eval_source else cfg
    if split == 1:
        yield from criteo_tsv_batches(training, batch_size, rank, world_size, split=1)
        return
    for _ in range(max(cfg.epochs, 1)):
        yield from criteo_tsv_batches(training, batch_size, rank, world_size, split=0)


def batches_per_epoch(cfg: DataConfig, batch_size: int, world_size: int) -> int:
    """Training batches that every rank of `world_size` gets from one pass over a file source
    (the fewest any rank has: ranks stop together), counted from the files' lines alone."""
    every = 0 if cfg.eval_source else held_out_every(cfg)
    samples = 0
    for path in tsv_files(cfg.source):
        lines = _count_lines(path)
        samples += lines - (lines // every if every else 0)
    fewest = samples // world_size  # the last rank's share
    return -(-fewest // batch_size)


def count_distinct_ids(cfg: DataConfig, progress: bool = True) -> list[int]:
    """Distinct IDs of each sparse feature over every line of a file source (distinct_ids)."""
    return distinct_ids(tsv_files(cfg.source), cfg.num_dense, cfg.num_sparse, progress)


def distinct_ids(files: list[Path], num_dense: int, num_sparse: int, progress: bool = True) -> list[int]:
    """Distinct IDs of each sparse feature over every line of the files, in one pass (a progress
    bar over the bytes read). A missing value is no ID; an ID is its column's hex string, so the
    count needs no hashing. Memory: the distinct strings of every column."""
    seen: list[set[str]] = [set() for _ in range(num_sparse)]
    first = 1 + num_dense
    with tqdm(
        total=sum(f.stat().st_size for f in files),
        desc="counting distinct IDs",
        unit="B",
        unit_scale=True,
        disable=not progress,
    ) as bar:
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                read = 0
                for n, line in enumerate(f, 1):
                    read += len(line)
                    if n % 65536 == 0:
                        bar.update(read)
                        read = 0
                    for column, value in zip(seen, line.rstrip("\n").split("\t")[first:]):
                        if value:
                            column.add(value)
                bar.update(read)
    return [len(column) for column in seen]


def _count_lines(path: Path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")  # a last line without its newline


def _tsv_batch(rows: list[tuple], keys: list[str]) -> Batch:
    labels = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    dense = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    values, lengths = [], []
    for f in range(len(keys)):
        for r in rows:
            i = r[2][f]
            lengths.append(0 if i is None else 1)
            if i is not None:
                values.append(i)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int32)
    )
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)
