"""XXH64 of int64 IDs on torch tensors (CPU or CUDA), equal to ps_server.hashing's numpy version.

The owner rank of an ID is xxh64(id) % world_size, the same function the PS client uses
to pick a PS, so one ID hashes alike everywhere. torch has no uint64 arithmetic, so this
works on int64 bit patterns: + and * wrap mod 2^64 as unsigned ones would, and right
shifts are made logical by masking off the sign bits that an arithmetic shift drags in.
"""

from __future__ import annotations

import torch


def _s(u: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


_P1, _P2, _P3 = _s(0x9E3779B185EBCA87), _s(0xC2B2AE3D27D4EB4F), _s(0x165667B19E3779F9)
_P4, _P5 = _s(0x85EBCA77C2B2AE63), _s(0x27D4EB2F165667C5)


def _shr(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x >> r) & ((1 << (64 - r)) - 1)


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x << r) | _shr(x, 64 - r)


def xxh64(ids: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """XXH64 of each id's 8 little-endian bytes, as int64 bit patterns."""
    x = ids.to(torch.int64)
    h = torch.full_like(x, _s((seed + 0x27D4EB2F165667C5 + 8) & ((1 << 64) - 1)))
    h = h ^ (_rotl(x * _P2, 31) * _P1)
    h = _rotl(h, 27) * _P1 + _P4
    h = h ^ _shr(h, 33)
    h = h * _P2
    h = h ^ _shr(h, 29)
    h = h * _P3
    return h ^ _shr(h, 32)


def unsigned_mod(h: torch.Tensor, n: int) -> torch.Tensor:
    """(h read as unsigned 64-bit) % n, for int64 bit patterns h."""
    wrap = (1 << 64) % n
    return torch.remainder(torch.remainder(h, n) + (h < 0).to(torch.int64) * wrap, n)


def owner_of(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank that owns each id: xxh64(id) % world_size."""
    if world_size == 1:
        return torch.zeros_like(ids, dtype=torch.int64)
    return unsigned_mod(xxh64(ids), world_size)
