"""The batch types of the trainer: TorchRec's Batch and KeyedJaggedTensor where TorchRec loads,
else a small stand-in of each with the part of their interface dynemb uses, so the plain
model (plain.py) trains where fbgemm-gpu, and with it TorchRec, cannot load (TorchRec
imports fbgemm-gpu's kernels on import).

    from dynemb.tables.jagged import Batch, KeyedJaggedTensor, TORCHREC_ERROR
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TORCHREC_ERROR: str | None = None  # why TorchRec did not load, where it did not

try:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
except Exception as exc:  # noqa: BLE001 - an ImportError, or fbgemm-gpu's library failing to load (OSError, RuntimeError)
    TORCHREC_ERROR = f"{type(exc).__name__}: {exc}"

    class KeyedJaggedTensor:  # type: ignore[no-redef]
        """Values of several keys, each key a bag per sample: values key after key, lengths
        (keys * stride) the bag sizes, optional weights (TorchRec's layout)."""

        def __init__(
            self,
            keys: list[str],
            values: torch.Tensor,
            lengths: torch.Tensor,
            weights: torch.Tensor | None = None,
            **_: object,  # TorchRec's cached layouts (offsets, stride, ...): recomputed here
        ) -> None:
            self._keys, self._values, self._lengths, self._weights = list(keys), values, lengths, weights

        @classmethod
        def from_lengths_sync(cls, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, weights=None):
            return cls(keys, values, lengths, weights)

        def keys(self) -> list[str]:
            return self._keys

        def values(self) -> torch.Tensor:
            return self._values

        def lengths(self) -> torch.Tensor:
            return self._lengths

        def weights_or_none(self) -> torch.Tensor | None:
            return self._weights

        def stride(self) -> int:
            return len(self._lengths) // max(len(self._keys), 1)

        def offsets(self) -> torch.Tensor:
            return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

        def length_per_key(self) -> list[int]:
            return self._lengths.view(len(self._keys), -1).sum(1).tolist() if self._keys else []

        def offset_per_key(self) -> list[int]:
            out = [0]
            for n in self.length_per_key():
                out.append(out[-1] + n)
            return out

        def __getitem__(self, key: str) -> KeyedJaggedTensor:
            k, at = self._keys.index(key), self.offset_per_key()
            s = self.stride()
            part = slice(at[k], at[k + 1])
            w = None if self._weights is None else self._weights[part]
            return KeyedJaggedTensor([key], self._values[part], self._lengths[k * s : (k + 1) * s], w)

        def to(self, device: torch.device, non_blocking: bool = False) -> KeyedJaggedTensor:
            w = None if self._weights is None else self._weights.to(device, non_blocking=non_blocking)
            return KeyedJaggedTensor(
                self._keys,
                self._values.to(device, non_blocking=non_blocking),
                self._lengths.to(device, non_blocking=non_blocking),
                w,
            )

        def pin_memory(self) -> KeyedJaggedTensor:
            w = None if self._weights is None else self._weights.pin_memory()
            return KeyedJaggedTensor(self._keys, self._values.pin_memory(), self._lengths.pin_memory(), w)

    @dataclass
    class Batch:  # type: ignore[no-redef]
        """A training batch: dense features (b, num_dense), sparse features, labels (b,)."""

        dense_features: torch.Tensor
        sparse_features: KeyedJaggedTensor
        labels: torch.Tensor

        def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
            return Batch(
                self.dense_features.to(device, non_blocking=non_blocking),
                self.sparse_features.to(device, non_blocking=non_blocking),
                self.labels.to(device, non_blocking=non_blocking),
            )

        def pin_memory(self) -> Batch:
            return Batch(self.dense_features.pin_memory(), self.sparse_features.pin_memory(), self.labels.pin_memory())


__all__ = ["TORCHREC_ERROR", "Batch", "KeyedJaggedTensor"]
