"""Optimizer slots of TF1 Saver checkpoints, from variable names.

tf.compat.v1.train optimizers name a slot variable '<variable>/<optimizer name>[_N]':
Adagrad's accumulator is 'emb/Adagrad', Adam's m and v are 'emb/Adam' and 'emb/Adam_1'
(a partitioned variable's slots are partitioned the same way and saved under the full
name too). Keras 2 optimizers in graph mode name them '<variable>/accumulator', '/m', '/v'.
"""

from __future__ import annotations

from dynemb.tf.bundle import TensorInfo

SUFFIXES = {
    "Adagrad": "accumulator",
    "accumulator": "accumulator",
    "Adam": "m",
    "Adam_1": "v",
    "m": "m",
    "v": "v",
    "Momentum": "momentum",
    "momentum": "momentum",
}


def slots(infos: dict[str, TensorInfo]) -> dict[str, dict[str, str]]:
    """{variable: {canonical slot name: slot tensor}} for slots of the variable's shape."""
    out: dict[str, dict[str, str]] = {}
    for name, info in infos.items():
        var, _, suffix = name.rpartition("/")
        if suffix in SUFFIXES and var in infos and infos[var].shape == info.shape:
            out.setdefault(var, {})[SUFFIXES[suffix]] = name
    return out
