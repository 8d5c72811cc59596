"""The KeyedJaggedTensor inside a user's batch, found and replaced.

A data loader yields whatever the model takes: a KJT alone, TorchRec's `Batch` (a dataclass
with `sparse_features`), a tuple or list, a dict, a NamedTuple or a dataclass of the user's
own. Dynamic tables transform the one KJT in it and hand the batch back as it came, the KJT
over slots in its place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dynemb.tables.jagged import KeyedJaggedTensor


class BatchLayoutError(TypeError):
    """A batch in which no single KeyedJaggedTensor could be found."""


def _members(batch: Any) -> list[tuple[Any, Any]]:
    """(key, value) of a container batch, in order; [] for anything else."""
    if isinstance(batch, dict):
        return list(batch.items())
    if isinstance(batch, (tuple, list)):
        return list(enumerate(batch))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)]
    return []


def find_kjt(batch: Any) -> Any:
    """Where the batch's KeyedJaggedTensor is: None for the batch itself, else its key, index or
    field name (one level down: the batch or one of its members is the KJT).

    Raises:
        BatchLayoutError: none, or more than one, with what was found.
    """
    if isinstance(batch, KeyedJaggedTensor):
        return None
    found = [key for key, value in _members(batch) if isinstance(value, KeyedJaggedTensor)]
    if len(found) == 1:
        return found[0]
    kind = type(batch).__name__
    if not found:
        raise BatchLayoutError(
            f"a batch of type {kind} holds no KeyedJaggedTensor: dynamic tables take batches that are a KJT, "
            f"or a tuple, list, dict, NamedTuple or dataclass with one KJT member (the sparse features)"
        )
    raise BatchLayoutError(
        f"a batch of type {kind} holds {len(found)} KeyedJaggedTensors ({', '.join(map(str, found))}): "
        f"dynamic tables transform one per batch; put every sparse feature in one KJT"
    )


def get_kjt(batch: Any, where: Any) -> KeyedJaggedTensor:
    """The KJT at `where` (find_kjt's answer)."""
    if where is None:
        return batch
    if isinstance(where, str) and not isinstance(batch, dict):
        return getattr(batch, where)
    return batch[where]


def with_kjt(batch: Any, where: Any, kjt: KeyedJaggedTensor) -> Any:
    """The batch with `kjt` in place of its KJT at `where`; the batch itself is not changed."""
    if where is None:
        return kjt
    if isinstance(batch, dict):
        return {**batch, where: kjt}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a NamedTuple
        return batch._replace(**{batch._fields[where]: kjt})  # type: ignore[attr-defined]
    if isinstance(batch, (tuple, list)):
        items = list(batch)
        items[where] = kjt
        return type(batch)(items)
    return dataclasses.replace(batch, **{where: kjt})
