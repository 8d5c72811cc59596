"""Write the TensorFlow test fixtures under tests/fixtures/tf/ with real TensorFlow.

TensorFlow is needed only here, never by dynemb: install it in a venv of its own, outside
the project's .venv. The TFRA fixtures need TensorFlow Recommenders-Addons, whose newest
release (0.8.1) loads only in TensorFlow 2.16, so they come from a second venv:

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0
    /tmp/tfvenv/bin/python scripts/make_tf_fixtures.py            # all but the tfra_* ones
    python3 -m venv /tmp/tfravenv && /tmp/tfravenv/bin/pip install tensorflow==2.16.2 \\
        tensorflow-recommenders-addons==0.8.1
    /tmp/tfravenv/bin/python scripts/make_tf_fixtures.py tfra_tf1 tfra_tf2

(made with tensorflow-cpu 2.21.0 / Keras 3.15.1, and tensorflow 2.16.2 +
tensorflow-recommenders-addons 0.8.1, Python 3.11.) Each fixture is written by its own
child process (TF1 graph mode and TF2 eager do not mix in one), its values set after a
training step has created the optimizer's slots, from tests/tf_fixture_values.py, which
the tests recompute. Files TensorFlow writes that dynemb does not read (TF1 .meta graphs)
are left out to keep the fixtures small.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tf_fixture_values import FIXTURES, TFRA_KEYS, TFRA_STRING_KEYS  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "tf"
TFRA = ("tfra_tf1", "tfra_tf2")


def quiet_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    return tf


def make_tf1_saver(out: Path) -> None:
    tf = quiet_tf()
    v1 = tf.compat.v1
    known = FIXTURES["tf1_saver"]
    v1.disable_eager_execution()
    with tf.Graph().as_default():
        zeros = v1.zeros_initializer()
        with v1.variable_scope("emb"):
            user = v1.get_variable("user", shape=[10, 4], initializer=zeros, partitioner=v1.fixed_size_partitioner(3))
            item = v1.get_variable("item", shape=[6, 8], initializer=zeros)
            tag = v1.get_variable("tag", shape=[5, 4], dtype=tf.bfloat16, initializer=zeros)
        v1.get_variable("misc/complex", shape=[2, 2], dtype=tf.complex64, initializer=zeros)  # no float
        step = v1.train.get_or_create_global_step()
        adagrad, adam = v1.train.AdagradOptimizer(0.1), v1.train.AdamOptimizer(0.1)
        train = tf.group(
            adagrad.minimize(tf.reduce_sum(tf.nn.embedding_lookup(user, [1, 5])), var_list=list(user)),
            adam.minimize(tf.reduce_sum(tf.gather(item, [0, 2])), var_list=[item], global_step=step),
        )
        sets = []
        full = {"values": known["emb/user"].array(), "accumulator": known["emb/user"].slot("accumulator")}
        for part in user:
            lo = part._get_save_slice_info().var_offset[0]
            rows = slice(lo, lo + part.shape[0])
            sets += [
                part.assign(full["values"][rows]),
                adagrad.get_slot(part, "accumulator").assign(full["accumulator"][rows]),
            ]
        k = known["emb/item"]
        sets += [
            item.assign(k.array()),
            adam.get_slot(item, "m").assign(k.slot("m")),
            adam.get_slot(item, "v").assign(k.slot("v")),
            tag.assign(tf.cast(known["emb/tag"].array(), tf.bfloat16)),
        ]
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train)
            sess.run(sets)
            v1.train.Saver().save(sess, str(out / "model.ckpt"), global_step=100, write_meta_graph=False)


def make_tf2_slot_variables(out: Path) -> None:
    tf = quiet_tf()
    known = FIXTURES["tf2_slot_variables"]
    model = tf.Module()
    model.user = tf.Variable(tf.zeros([12, 4]))
    model.item = tf.Variable(tf.zeros([7, 6]))
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model.user) + tf.reduce_sum(model.item)
    variables = [model.user, model.item]
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    for var, k in zip(variables, (known["model/user"], known["model/item"])):
        var.assign(k.array())
        opt.get_slot(var, "m").assign(k.slot("m"))
        opt.get_slot(var, "v").assign(k.slot("v"))
    tf.train.Checkpoint(model=model, optimizer=opt).save(str(out / "ckpt"))


def _user_after_a_step(tf, shape: list[int], opt):
    """A tf.Module with one variable `user` of `shape`, after one training step of `opt`: the
    optimizer has made its slots for it."""
    model = tf.Module()
    model.user = tf.Variable(tf.zeros(shape))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model.user)
    opt.apply_gradients([(tape.gradient(loss, model.user), model.user)])
    return model


def make_tf2_keras3(out: Path) -> None:
    tf = quiet_tf()
    import keras

    k = FIXTURES["tf2_keras3"]["model/user"]
    opt = keras.optimizers.Adagrad(0.1)
    model = _user_after_a_step(tf, [9, 5], opt)
    model.user.assign(k.array())
    opt._accumulators[0].assign(k.slot("accumulator"))
    tf.train.Checkpoint(model=model, optimizer=opt).save(str(out / "ckpt"))


def make_saved_model(out: Path) -> None:
    tf = quiet_tf()
    import keras

    k = FIXTURES["saved_model"]["model/user"]
    opt = keras.optimizers.Adam(0.1)
    model = _user_after_a_step(tf, [8, 4], opt)
    model.optimizer = opt  # saved with the model: its slots are what the fixture is for
    model.user.assign(k.array())
    opt._momentums[0].assign(k.slot("m"))
    opt._velocities[0].assign(k.slot("v"))
    root = tf.Module()
    root.model = model
    tf.saved_model.save(root, str(out))


def _keras_model(optimizer, known, embeddings=(("user_emb", 11, 4), ("item_emb", 5, 6))):
    """A Keras 3 model: an Embedding layer (name, rows, dim) per input, flattened, concatenated,
    then a Dense layer `head`; trained one step so the optimizer's slots exist, then given the
    known values. A `known` key is a layer (its embeddings) or a variable path (head/kernel)."""
    import keras
    import numpy as np

    inputs = [keras.Input((1,), dtype="int32", name=name.removesuffix("_emb")) for name, _, _ in embeddings]
    concat = keras.layers.Concatenate()
    x = concat(
        [
            keras.layers.Flatten()(keras.layers.Embedding(rows, dim, name=name)(one))
            for (name, rows, dim), one in zip(embeddings, inputs)
        ]
    )
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model.compile(optimizer=optimizer, loss="mse")
    model.fit([np.arange(10) % rows for _, rows, _ in embeddings], np.ones(10), epochs=1, verbose=0)
    paths = [v.path for v in model.trainable_variables]
    lists = {"accumulator": "_accumulators", "m": "_momentums", "v": "_velocities"}
    for name, k in known.items():
        var = model.trainable_variables[paths.index(name)] if name in paths else model.get_layer(name).embeddings
        var.assign(k.array())
        index = paths.index(var.path)
        for slot in k.slots:
            getattr(optimizer, lists[slot])[index].assign(k.slot(slot))
    return model


def make_keras_weights(out: Path) -> None:
    quiet_tf()
    import keras

    model = _keras_model(keras.optimizers.Adam(0.01), FIXTURES["keras_weights"])
    model.save_weights(str(out / "model.weights.h5"))


def make_keras_model(out: Path) -> None:
    quiet_tf()
    import keras

    model = _keras_model(keras.optimizers.Adagrad(0.01), FIXTURES["keras_model"])
    model.save(str(out / "model.keras"))


def make_keras_checkpoint(out: Path) -> None:
    """A Keras model saved with tf.train.Checkpoint, not model.save: the checkpoint keys of its
    variables are the optimizer's (optimizer/_trainable_variables/N), their layer names are only
    in the object graph. Two embeddings of one shape, so that shape cannot tell them apart."""
    tf = quiet_tf()
    import keras

    optimizer = keras.optimizers.Adam(0.01)
    model = _keras_model(optimizer, FIXTURES["keras_checkpoint"], (("user_emb", 10, 4), ("item_emb", 10, 4)))
    tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(out / "ckpt"))


def make_tfra_tf1(out: Path) -> None:
    tf = quiet_tf()
    import tensorflow_recommenders_addons as tfra

    de, v1 = tfra.dynamic_embedding, tf.compat.v1
    v1.disable_eager_execution()
    known = FIXTURES["tfra_tf1"]
    with tf.Graph().as_default():
        user = de.get_variable(
            "user_de", key_dtype=tf.int64, value_dtype=tf.float32, dim=4, devices=["/CPU:0", "/CPU:0"], initializer=0.0
        )
        item = de.get_variable("item_de", key_dtype=tf.int64, value_dtype=tf.float32, dim=3, initializer=0.0)
        ids = tf.constant([3, 17], tf.int64)  # the step creates slot rows for these two keys only
        adam = de.DynamicEmbeddingOptimizer(v1.train.AdamOptimizer(0.1))
        adagrad = de.DynamicEmbeddingOptimizer(v1.train.AdagradOptimizer(0.1))
        train = tf.group(
            adam.minimize(tf.reduce_sum(de.embedding_lookup(user, ids, name="user_lookup"))),
            adagrad.minimize(tf.reduce_sum(de.embedding_lookup(item, ids, name="item_lookup"))),
        )
        keys = tf.constant(TFRA_KEYS, tf.int64)
        sets = []
        for var, opt, k in ((user, adam, known["user_de"]), (item, adagrad, known["item_de"])):
            sets.append(var.upsert(keys, k.array()))
            keep = [n for n, key in enumerate(k.keys) if key not in k.slot_missing]
            slot_keys = tf.constant([k.keys[n] for n in keep], tf.int64)
            for slot_var in var.get_slot_variables(opt):
                slot = slot_var.name.rsplit("/", 1)[-1]  # user_de/Adam/m → m
                sets.append(slot_var.upsert(slot_keys, k.slot(slot)[keep]))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train)
            sess.run(sets)
            v1.train.Saver().save(sess, str(out / "model"), write_meta_graph=False)


def make_tfra_tf2(out: Path) -> None:
    tf = quiet_tf()
    import tensorflow_recommenders_addons as tfra

    k = FIXTURES["tfra_tf2"]["words"]
    model = tf.Module()
    model.words = tfra.dynamic_embedding.get_variable(
        "words", key_dtype=tf.string, value_dtype=tf.float32, dim=4, devices=["/CPU:0", "/CPU:0"]
    )
    model.words.upsert(tf.constant(TFRA_STRING_KEYS), k.array())
    tf.train.Checkpoint(model=model).save(str(out / "ckpt"))


MAKERS = {name.removeprefix("make_"): fn for name, fn in globals().items() if name.startswith("make_")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "fixtures",
        nargs="*",
        metavar="FIXTURE",
        help=f"which to write [default: all but {', '.join(TFRA)}]: {', '.join(MAKERS)}",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [n for n in args.fixtures if n not in MAKERS]
    if unknown:
        parser.error(f"unknown fixture(s) {unknown}; choose from {list(MAKERS)}")
    names = args.fixtures or [n for n in MAKERS if n not in TFRA]
    if args.child:  # one fixture, in this process
        (name,) = names
        MAKERS[name](OUT / name)
        return 0
    for name in names:
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        subprocess.run([sys.executable, __file__, "--child", name], check=True)
        state = out / "checkpoint"  # TensorFlow writes absolute paths there: make them relative
        if state.exists():
            state.write_text(state.read_text().replace(f"{out}/", ""))
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        print(f"wrote {out.relative_to(ROOT)} ({size:,} bytes)")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"tests/fixtures/tf: {total:,} bytes in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
