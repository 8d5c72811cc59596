"""What a transform gives: one table's batch (TransformResult) and many tables' in one call
(ManyResult). Records only: the backends (transformer.py, many.py, bucket_tables.py) make them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TransformResult:
    """What IDTransformer.transform gives for a batch.

    Attributes:
        slots: the slot of each id (the batch's shape); -1 where not admitted.
        admitted_ids, admitted_slots: IDs given a slot by this call, and their slots.
        evicted_ids, evicted_slots: IDs evicted to make room, and the slots they left.
    """

    slots: torch.Tensor
    admitted_ids: torch.Tensor
    admitted_slots: torch.Tensor
    evicted_ids: torch.Tensor
    evicted_slots: torch.Tensor
    rejected_ids: torch.Tensor  # seen, but below the admission threshold: no slot yet
    # how many of the batch's IDs (sightings) were resident before the call: a 0-dim tensor
    # on the transformer's device (int() it when needed; on CUDA that is a sync)
    hits: torch.Tensor | int = 0
    # every slot the batch uses, once (resident ones seen, then the admitted): what pin holds
    distinct_slots: torch.Tensor | None = None


class ManyResult:
    """slots: every block's slots, in the layout of the IDs; errors: per table, what its
    transform raised, or None. Per table, results[t]: its TransformResult, or None where it
    failed. From the kernel the tables' admitted and evicted IDs and slots and distinct slots
    come as one tensor each, table after table (`flat`, with `counts`: per table, how many of
    each; the triton backend adds "rejected_ids"), and the per-table results are cut from them only
    when first asked for: a caller that handles all tables at once (the trainer's row moves,
    release_many) takes them whole."""

    FIELDS = ("admitted_ids", "admitted_slots", "evicted_ids", "evicted_slots", "distinct_slots")

    def __init__(
        self,
        slots: torch.Tensor,
        results: list[TransformResult | None] | None,
        errors: list[Exception | None],
        flat: dict[str, torch.Tensor] | None = None,
        counts: dict[str, list[int]] | None = None,
        sizes: list[int] | None = None,
        hits: list[int] | None = None,
        dropped: list[int] | None = None,
    ) -> None:
        self.slots, self.errors = slots, errors
        self._results = results
        self.flat, self.counts = flat, counts
        self.sizes, self.hits = sizes, hits  # with flat: per table, IDs looked up and hits (0 if failed)
        # per table, how many of its IDs got no slot (-1: not admitted), where the host knows it
        # without reading the slots (the triton backend counts them into its one copy); else None
        self.dropped = dropped

    def flat_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]], list[int], list[int]]:
        """(flat, counts, sizes, hits): every table's share as the kernel gave it, whole.
        Raises ValueError for a result made of per-table results (it has none of them)."""
        flat, counts, sizes, hits = self.flat, self.counts, self.sizes, self.hits
        if flat is None or counts is None or sizes is None or hits is None:
            raise ValueError("this ManyResult holds per-table results, not the kernel's flat tensors")
        return flat, counts, sizes, hits

    @property
    def results(self) -> list[TransformResult | None]:
        """Per table, its TransformResult or None where it failed (cut from the flat tensors when first asked for)."""
        if self._results is None:  # made with the kernel's flat tensors instead
            flat, counts, sizes, hits = self.flat_parts()
            parts = {f: torch.split(flat[f], counts[f]) for f in self.FIELDS}
            rejected = torch.split(flat["rejected_ids"], counts["rejected_ids"]) if "rejected_ids" in flat else None
            no_ids = self.slots[:0]
            self._results = [
                None
                if e is not None
                else TransformResult(
                    slots=slots,
                    rejected_ids=no_ids if rejected is None else rejected[k],
                    hits=hits[k],
                    **{f: parts[f][k] for f in self.FIELDS},
                )
                for k, (slots, e) in enumerate(zip(torch.split(self.slots, sizes), self.errors))
            ]
        return self._results

    @property
    def error(self) -> Exception | None:
        """The first table's error, if any failed."""
        return next((e for e in self.errors if e is not None), None)
