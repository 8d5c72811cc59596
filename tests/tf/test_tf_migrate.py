"""`dynemb tf ls|migrate` on checkpoints written by real TensorFlow (tests/fixtures/tf, made by
scripts/make_tf_fixtures.py): every format into table files and into a real PS process,
compared exactly with the known values (tests/tf_fixture_values.py); ids by row index,
offset, vocabulary and TFRA keys; optimizer state per target optimizer; and corrupt,
truncated, mistyped or misfitting input refused before anything is written."""

from __future__ import annotations

import shutil
import uuid
import zipfile
from pathlib import Path

import numpy as np
import pytest
import xxhash
from helpers import TESTS, dynemb
from tf_fixture_values import FIXTURES, Known

from dynemb.checkpoint.table_files import TableReader
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import TableNotFound
from dynemb.ps_server.initializer import float_to_bf16_bits
from dynemb.ps_server.schema import Initializer
from dynemb.tf import migrate
from dynemb.tf.bundle import Bundle
from dynemb.tf.errors import TFMigrationError
from dynemb.tf.source import open_source

FIX = TESTS / "fixtures" / "tf"

# (fixture path, tensor as given to --table, its Known, target optimizer)
CASES = [
    ("tf1_saver", "emb/user", FIXTURES["tf1_saver"]["emb/user"], "adagrad"),  # partitioned, 3 slices
    ("tf1_saver", "emb/item", FIXTURES["tf1_saver"]["emb/item"], "adam"),
    ("tf2_slot_variables", "model/user", FIXTURES["tf2_slot_variables"]["model/user"], "adam"),
    (
        "tf2_slot_variables",
        "model/item/.ATTRIBUTES/VARIABLE_VALUE",
        FIXTURES["tf2_slot_variables"]["model/item"],
        "adam",
    ),
    ("tf2_keras3", "model/user", FIXTURES["tf2_keras3"]["model/user"], "adagrad"),
    ("saved_model", "model/user", FIXTURES["saved_model"]["model/user"], "adam"),
    ("tfra_tf1", "user_de", FIXTURES["tfra_tf1"]["user_de"], "adam"),  # 2 hash tables
    ("tfra_tf1", "item_de", FIXTURES["tfra_tf1"]["item_de"], "adagrad"),
    ("tfra_tf2", "words", FIXTURES["tfra_tf2"]["words"], "sgd"),  # string keys
    ("keras_weights/model.weights.h5", "user_emb", FIXTURES["keras_weights"]["user_emb"], "adam"),
    ("keras_weights/model.weights.h5", "layers/embedding_1/vars/0", FIXTURES["keras_weights"]["item_emb"], "adam"),
    ("keras_model/model.keras", "user_emb", FIXTURES["keras_model"]["user_emb"], "adagrad"),
    ("keras_model/model.keras", "item_emb", FIXTURES["keras_model"]["item_emb"], "rowwise_adagrad"),
    # keys optimizer/_trainable_variables/N; the names below are the object graph's
    ("keras_checkpoint", "user_emb", FIXTURES["keras_checkpoint"]["user_emb/embeddings"], "adam"),
    ("keras_checkpoint", "item_emb/embeddings", FIXTURES["keras_checkpoint"]["item_emb/embeddings"], "adam"),
]
IDS = [f"{c[0].split('/')[0]}:{c[1].split('/')[-1] if 'vars' not in c[1] else 'item_emb'}:{c[3]}" for c in CASES]


def signed_xxh64(raw: bytes) -> int:
    return int(np.array([xxhash.xxh64_intdigest(raw)], np.uint64).view(np.int64)[0])


def expected(known: Known, optimizer: str, state_init: float = 0.0, offset: int = 0):
    """(ids, embeddings, state) as float32 rows the migration must produce."""
    n, dim = known.rows, known.dim
    if known.keys:
        ids = np.array([k if isinstance(k, int) else signed_xxh64(k) for k in known.keys], np.int64)
    else:
        ids = np.arange(n, dtype=np.int64) + offset
    missing = np.isin(
        np.array([k if isinstance(k, int) else 0 for k in known.keys] or [0] * n), [k for k in known.slot_missing]
    )

    def slot(name: str) -> np.ndarray:
        if name not in known.slots:
            return np.full((n, dim), state_init, np.float32)
        values = known.slot(name).copy()
        values[missing] = state_init
        return values

    if optimizer == "sgd":
        state = np.zeros((n, 0), np.float32)
    elif optimizer == "adagrad":
        state = slot("accumulator")
    elif optimizer == "rowwise_adagrad":
        state = known.slot("accumulator").astype(np.float64).mean(axis=1, keepdims=True).astype(np.float32)
        state[missing] = state_init
    else:
        state = np.concatenate([slot("m"), slot("v")], axis=1)
    return ids, known.array(), state


def read_folder(folder: Path):
    parts = list(zip(*TableReader(folder).chunks()))
    return tuple(np.concatenate(p) for p in parts)


def assert_rows_equal(got, want):
    """got/want: (ids, emb, state); compared exactly, in id order."""
    g, w = np.argsort(got[0]), np.argsort(want[0])
    assert np.array_equal(got[0][g], want[0][w])
    for a, b in zip(got[1:], want[1:]):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        assert np.array_equal(a[g].view(np.uint8), b[w].view(np.uint8))


def refused(message: str):
    """pytest.raises for a TFMigrationError whose message matches the regex `message`."""
    return pytest.raises(TFMigrationError, match=message)


def run_migrate(path, specs, optimizer, *, out=None, ps=None, dtype="fp32", state_init=0.0, replace=False):
    source = open_source(str(FIX / path) if not Path(path).is_absolute() else path)
    plans = migrate.plan(
        source, [migrate.TableSpec.parse(s) for s in specs], optimizer, dtype, Initializer(state_init=state_init)
    )
    migrate.verify(plans, progress=False)
    if out is not None:
        return migrate.to_files(out, plans, source, rows_per_shard=4, progress=False), plans
    migrate.check_ps(ps, plans)
    return migrate.to_ps(ps, plans, replace=replace, progress=False), plans


@pytest.mark.parametrize("path, tensor, known, optimizer", CASES, ids=IDS)
def test_every_format_into_table_files(tmp_path, path, tensor, known, optimizer):
    folders, plans = run_migrate(path, [f"t={tensor}"], optimizer, out=tmp_path)
    manifest = TableReader(folders["t"]).manifest
    assert manifest.schema.dim == known.dim and manifest.num_rows == known.rows
    assert manifest.source["kind"] == "tensorflow" and manifest.source["optimizer"] == optimizer
    assert_rows_equal(read_folder(tmp_path / "t"), expected(known, optimizer))


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("path, tensor, known, optimizer", CASES, ids=IDS)
def test_every_format_into_a_real_ps(embedded_client, path, tensor, known, optimizer):
    name = unique("tf")
    written, _ = run_migrate(path, [f"{name}={tensor}"], optimizer, ps=embedded_client)
    assert written == {name: known.rows}
    ids, emb, state = expected(known, optimizer)
    got = embedded_client.pull(name, ids)
    assert not got.missing.any()
    assert np.array_equal(got.rows, np.concatenate([emb, state], axis=1))
    assert embedded_client.describe_table(name).schema.state_width == state.shape[1]


def test_keras_layers_saved_with_tf_train_checkpoint_are_found_by_their_names(tmp_path):
    """Keys say optimizer/_trainable_variables/N; the object graph knows user_emb/embeddings."""
    source = open_source(str(FIX / "keras_checkpoint"))
    key = "optimizer/_trainable_variables/{}/.ATTRIBUTES/VARIABLE_VALUE"
    for names, n in (
        (("user_emb", "user_emb/embeddings", "model/_operations/2/_embeddings"), 0),
        (("item_emb", "item_emb/embeddings", "model/_operations/3/_embeddings"), 1),
        (("head", "head/kernel", "model/_operations/7/_kernel"), 2),
    ):
        for name in (*names, key.format(n), key.format(n).removesuffix("/.ATTRIBUTES/VARIABLE_VALUE")):
            assert source.table(name).name == key.format(n), name
        assert source.shown(key.format(n)) == names[1]
    # the two embeddings have one shape: each keeps its own values and slots
    known = FIXTURES["keras_checkpoint"]
    run_migrate("keras_checkpoint", ["u=user_emb", "i=item_emb", "h=head"], "adam", out=tmp_path)
    for table, name in (("u", "user_emb/embeddings"), ("i", "item_emb/embeddings"), ("h", "head/kernel")):
        assert_rows_equal(read_folder(tmp_path / table), expected(known[name], "adam"))
    # a slot by the optimizer's name for it; a name two variables share is refused, not guessed
    run_migrate("keras_checkpoint", ["w=user_emb,m=adam/item_emb_embeddings_momentum"], "adam", out=tmp_path)
    assert np.array_equal(read_folder(tmp_path / "w")[2][:, :4], known["item_emb/embeddings"].slot("m"))
    with refused(r"'Variable' could name any of model/item, model/user; give one of those names"):
        run_migrate("tf2_slot_variables", ["x=Variable"], "adam", out=tmp_path)


@pytest.mark.parametrize(
    "path, embeddings, others",
    [
        ("keras_checkpoint", ["item_emb/embeddings", "user_emb/embeddings"], ["head/kernel"]),  # Embedding layers
        ("keras_weights/model.weights.h5", ["item_emb", "user_emb"], ["head"]),  # h5 keys layers/embedding...
        ("tf1_saver", ["emb/item", "emb/tag", "emb/user"], []),  # emb in the names; emb/user is partitioned too
        ("tfra_tf1", ["item_de", "user_de"], []),  # TFRA tables
        ("tf2_slot_variables", [], ["model/item", "model/user"]),  # nothing says embedding
    ],
)
def test_likely_embeddings_are_told_from_other_2d_variables(path, embeddings, others):
    source = open_source(str(FIX / path))
    found = {source.shown(n): t.embedding for n, t in source.tables().items()}
    assert found == {**dict.fromkeys(embeddings, True), **dict.fromkeys(others, False)}


def test_moving_a_variable_that_is_no_embedding_says_so(tmp_path):
    _, plans = run_migrate("keras_checkpoint", ["h=head", "u=user_emb"], "adam", out=tmp_path)
    assert [n for n in plans[0].notes if "embedding" in n] == [
        "'h': head/kernel is not named or made like an embedding (it is listed under other 2-D variables by "
        "`dynemb tf ls`); moved all the same"
    ]
    assert not [n for n in plans[1].notes if "embedding" in n]
    res = dynemb(
        *"tf migrate tests/fixtures/tf/keras_checkpoint --optimizer adam --table h2=head --table u2=user_emb".split(),
        "--quiet",
        "--out",
        str(tmp_path),
        keep_carriage_returns=True,
    )
    assert res.returncode == 0, res.stderr
    assert "note: 'h2': head/kernel is not named or made like an embedding" in res.stderr
    assert res.stdout.splitlines()[1] == (  # the names `tf ls` lists, not optimizer/_trainable_variables/0/...
        f"migrated user_emb/embeddings (10 rows x 4, adam state from slots: m=adam/user_emb_embeddings_momentum, "
        f"v=adam/user_emb_embeddings_velocity) -> folder {tmp_path / 'u2'}"
    )


def test_adagrad_accumulator_into_each_target_optimizer(tmp_path):
    known = FIXTURES["tf1_saver"]["emb/user"]
    for optimizer in ("sgd", "adagrad", "rowwise_adagrad"):
        run_migrate("tf1_saver", [f"{optimizer}=emb/user"], optimizer, out=tmp_path)
        assert_rows_equal(read_folder(tmp_path / optimizer), expected(known, optimizer))
    # Adam from an Adagrad checkpoint: no m or v there, so the state starts at state_init
    _, plans = run_migrate("tf1_saver", ["adam=emb/user"], "adam", out=tmp_path, state_init=0.25)
    assert any("no m slot" in n for n in plans[0].notes) and any("accumulator not kept" in n for n in plans[0].notes)
    assert_rows_equal(read_folder(tmp_path / "adam"), expected(known, "adam", state_init=0.25))


def test_row_wise_adagrad_state_is_the_row_mean_of_the_accumulator(tmp_path):
    known = FIXTURES["tf1_saver"]["emb/user"]
    run_migrate("tf1_saver", ["u=emb/user"], "rowwise_adagrad", out=tmp_path)
    _, _, state = read_folder(tmp_path / "u")
    acc = known.slot("accumulator")
    assert state.shape == (10, 1)
    assert np.allclose(state[:, 0], acc.mean(axis=1), rtol=1e-7)
    assert not np.allclose(state[:, 0], acc[:, 0])  # not just the first column


def test_dtypes_bfloat16_and_fp16(tmp_path):
    tag = FIXTURES["tf1_saver"]["emb/tag"]  # stored as bfloat16
    run_migrate("tf1_saver", ["tag16=emb/tag"], "sgd", out=tmp_path, dtype="bf16")
    ids, emb, _ = read_folder(tmp_path / "tag16")
    assert emb.dtype == np.uint16 and np.array_equal(emb[np.argsort(ids)], float_to_bf16_bits(tag.array()))
    run_migrate("tf1_saver", ["tag32=emb/tag"], "sgd", out=tmp_path)
    assert np.array_equal(read_folder(tmp_path / "tag32")[1], tag.array())  # exact: bf16 widens to fp32

    user = FIXTURES["tf1_saver"]["emb/user"]
    run_migrate("tf1_saver", ["half=emb/user"], "adagrad", out=tmp_path, dtype="fp16")
    _, emb, state = read_folder(tmp_path / "half")
    assert emb.dtype == np.float16 and np.array_equal(emb, user.array().astype(np.float16))
    assert np.array_equal(state, user.slot("accumulator").astype(np.float16))


def test_ids_by_offset_and_by_vocabulary(tmp_path):
    known = FIXTURES["tf1_saver"]["emb/item"]  # 6 rows
    run_migrate("tf1_saver", ["a=emb/item,offset=1000000"], "adam", out=tmp_path)
    assert_rows_equal(read_folder(tmp_path / "a"), expected(known, "adam", offset=1_000_000))

    ids = [42, -7, 1 << 62, 0, 9, 123456789]
    (tmp_path / "ids.txt").write_text("".join(f"{i}\n" for i in ids))
    run_migrate("tf1_saver", [f"b=emb/item,vocab={tmp_path / 'ids.txt'}"], "adam", out=tmp_path)
    got = read_folder(tmp_path / "b")
    assert got[0].tolist() == ids and np.array_equal(got[1], known.array())

    tokens = ["red", "green", "blue", "", "\u00fcber", "r\u00e9sum\u00e9"]
    (tmp_path / "tokens.txt").write_text("\r\n".join(tokens) + "\r\n", encoding="utf-8")
    run_migrate("tf1_saver", [f"c=emb/item,vocab={tmp_path / 'tokens.txt'},vocab-kind=tokens"], "adam", out=tmp_path)
    got = read_folder(tmp_path / "c")
    assert got[0].tolist() == [signed_xxh64(t.encode()) for t in tokens]
    assert np.array_equal(got[2], expected(known, "adam")[2])


def test_tfra_slots_are_matched_by_key_and_a_missing_key_gets_state_init(tmp_path):
    known = FIXTURES["tfra_tf1"]["user_de"]
    run_migrate("tfra_tf1", ["u=user_de"], "adam", out=tmp_path, state_init=0.5)
    ids, _, state = read_folder(tmp_path / "u")
    row_of_8 = int(np.flatnonzero(ids == 8)[0])
    assert np.all(state[row_of_8] == 0.5)  # key 8 was never trained: no m or v rows for it
    assert_rows_equal((ids, read_folder(tmp_path / "u")[1], state), expected(known, "adam", state_init=0.5))


def assert_nothing_written(ps: PSClient, *tables: str) -> None:
    for table in tables:
        with pytest.raises(TableNotFound):
            ps.describe_table(table)


@pytest.fixture
def tf1_copy(tmp_path) -> Path:
    dst = tmp_path / "tf1"
    shutil.copytree(FIX / "tf1_saver", dst)
    return dst


def corrupt_emb_user(tf1: Path) -> Path:
    """Flip a bit in the second slice of emb/user in a copy of tf1_saver; returns the data file."""
    prefix = tf1 / "model.ckpt-100"
    entry = Bundle(str(prefix))._pieces("emb/user")[1][0]
    data = Path(f"{prefix}.data-00000-of-00001")
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 5] ^= 0x01
    data.write_bytes(bytes(raw))
    return data


def test_a_corrupt_data_file_is_refused_and_nothing_is_written(embedded_client, tf1_copy):
    corrupt_emb_user(tf1_copy)
    good, bad = unique("good"), unique("bad")
    with refused(
        r"model\.ckpt-100\.data-00000-of-00001: tensor 'emb/user' .* has CRC-32C 0x[0-9a-f]{8}, "
        r"the index records 0x[0-9a-f]{8}: the data file is corrupt"
    ):
        run_migrate(str(tf1_copy), [f"{good}=emb/item", f"{bad}=emb/user"], "adam", ps=embedded_client)
    assert_nothing_written(embedded_client, good, bad)  # the good table waits for the bad one's check


def test_truncated_files_are_refused(tmp_path, tf1_copy):
    prefix = tf1_copy / "model.ckpt-100"
    data = Path(f"{prefix}.data-00000-of-00001")
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    with refused(
        rf"data-00000-of-00001: {size // 2} bytes, but tensor .* is at bytes \[\d+, \d+\): the file is truncated"
    ):
        run_migrate(str(tf1_copy), ["a=emb/item", "b=emb/user"], "adam", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()

    index = Path(f"{prefix}.index")
    index.write_bytes(index.read_bytes()[:-20])
    with refused(r"model\.ckpt-100\.index: not a TensorFlow checkpoint index"):
        open_source(str(tf1_copy))


def test_a_corrupt_index_block_is_refused(tf1_copy):
    index = Path(f"{tf1_copy / 'model.ckpt-100'}.index")
    raw = bytearray(index.read_bytes())
    at = raw.find(b"emb/item")  # a key inside the data block
    raw[at] ^= 0x20
    index.write_bytes(bytes(raw))
    with refused(r"\.index: the block at byte 0 fails its CRC-32C check: the file is corrupt"):
        open_source(str(tf1_copy))


def test_unreadable_dtype_and_non_float_tables_are_refused(tmp_path):
    source = open_source(str(FIX / "tf1_saver"))
    with refused(
        r"tensor 'misc/complex' has dtype complex64 \(TensorFlow DataType 8\), which dynemb cannot read as numbers"
    ):
        source.rows("misc/complex").read(0, 2)
    with refused(r"table 'c' \(misc/complex\): dtype complex64; an embedding must be a float tensor"):
        run_migrate("tf1_saver", ["c=misc/complex"], "sgd", out=tmp_path)
    with refused(r"table 'b' \(beta1_power\): shape \[\]; an embedding table is \(rows, dim\)"):
        run_migrate("tf1_saver", ["b=beta1_power"], "sgd", out=tmp_path)
    with refused(r"no tensor or table named 'emb/nope'; tables found: emb/item, emb/tag, emb/user"):
        run_migrate("tf1_saver", ["x=emb/nope"], "sgd", out=tmp_path)
    assert not any(tmp_path.iterdir())


def test_shapes_that_do_not_fit_the_target_are_refused(embedded_client, tmp_path):
    name = unique("dim8")
    embedded_client.create_table(name, dim=8, state_width=8)
    with refused(
        rf"table '{name}' exists on the PS with dim 8 \(the checkpoint needs 4\), "
        r"state_width 8 \(--optimizer adagrad needs 4\)"
    ):
        run_migrate("tf1_saver", [f"{name}=emb/user"], "adagrad", ps=embedded_client)
    assert embedded_client.describe_table(name).num_rows == 0
    half = unique("bf16")
    embedded_client.create_table(half, dim=4, state_width=4, dtype="bf16")
    with refused(rf"table '{half}' exists on the PS with dtype 'bf16' \(--dtype asks for 'fp32'\)"):
        run_migrate("tf1_saver", [f"{half}=emb/user"], "adagrad", ps=embedded_client)
    with refused(r"slot accumulator \(emb/item/Adam\) has shape \[6, 8\], the table's values are \[10, 4\]"):
        run_migrate("tf1_saver", ["u=emb/user,accumulator=emb/item/Adam"], "adagrad", out=tmp_path)


@pytest.mark.parametrize(
    "lines, message",
    [
        (["1", "2", "3"], r"ids\.txt: 3 lines, but the tensor of table 'v' has 6 rows"),
        (["1", "2", "3", "4", "2", "6"], r"ids\.txt: id 2 appears more than once \(rows 1 and 4\)"),
        (["1", "2", "x3", "4", "5", "6"], r"ids\.txt:3: 'x3' is not an integer id"),
    ],
)
def test_bad_vocabularies_are_refused(tmp_path, lines, message):
    (tmp_path / "ids.txt").write_text("\n".join(lines) + "\n")
    with refused(message):
        run_migrate("tf1_saver", [f"v=emb/item,vocab={tmp_path / 'ids.txt'}"], "adam", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nothing", r"expected NAME=TENSOR\[,key=value\.\.\.\]"),
        ("a=emb/item,color=red", r"'color=red' is not one of offset=\.\.\., vocab=\.\.\."),
        ("a=emb/item,offset=ten", "offset must be an integer, got 'ten'"),
        ("a=emb/item,vocab-kind=words", "vocab-kind must be ids or tokens"),
    ],
)
def test_bad_table_specs(spec, message):
    with refused(message):
        migrate.TableSpec.parse(spec)


def test_the_tf_error_is_not_the_training_checkpoint_error():
    """dynemb/tf's error once shared its name with checkpoint_format.CheckpointError, an
    unrelated class: `except CheckpointError` caught one and not the other, by name alone."""
    from dynemb.checkpoint import format as checkpoint_format
    from dynemb.common.errors import UserError
    from dynemb.tf import errors

    assert not hasattr(errors, "CheckpointError")
    assert issubclass(TFMigrationError, UserError)  # the CLI prints it in one line
    assert not issubclass(TFMigrationError, checkpoint_format.CheckpointError)
    assert not issubclass(checkpoint_format.CheckpointError, TFMigrationError)


def test_keras_files_corrupt_or_truncated(tmp_path):
    keras = tmp_path / "model.keras"
    raw = bytearray((FIX / "keras_model" / "model.keras").read_bytes())
    with zipfile.ZipFile(FIX / "keras_model" / "model.keras") as z:
        info = z.getinfo("model.weights.h5")
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
    raw[at] ^= 0xFF
    keras.write_bytes(bytes(raw))
    with refused(r"model\.keras: not a readable \.keras archive .*CRC"):
        open_source(str(keras))
    h5 = tmp_path / "model.weights.h5"
    h5.write_bytes((FIX / "keras_weights" / "model.weights.h5").read_bytes()[:5000])
    with refused(r"model\.weights\.h5: not a readable HDF5 file"):
        open_source(str(h5))


def test_checkpoint_paths(tmp_path):
    tf1 = FIX / "tf1_saver"
    prefix = tf1 / "model.ckpt-100"
    for given in (tf1, prefix, f"{prefix}.index", f"{prefix}.data-00000-of-00001"):
        assert open_source(str(given)).path.endswith("model.ckpt-100")
    sharded = tmp_path / "model.ckpt-100.data-00001-of-00002"  # any shard names the prefix
    with refused(r"model\.ckpt-100: not a checkpoint \(no .*/model\.ckpt-100\.index\)"):
        open_source(str(sharded))
    assert open_source(str(FIX / "saved_model")).kind == "SavedModel variables"
    with pytest.raises(TFMigrationError, match="not a checkpoint"):
        open_source(str(tmp_path / "nothing"))


TF1_LS = """\
tests/fixtures/tf/tf1_saver/model.ckpt-100: TF1 Saver checkpoint, 10 tensors
TENSOR            DTYPE      SHAPE    ROLE
beta1_power       float32    []
beta2_power       float32    []
emb/item          float32    [6, 8]   table
emb/item/Adam     float32    [6, 8]   m slot of emb/item
emb/item/Adam_1   float32    [6, 8]   v slot of emb/item
emb/tag           bfloat16   [5, 4]   table
emb/user          float32    [10, 4]  table
emb/user/Adagrad  float32    [10, 4]  accumulator slot of emb/user
global_step       int64      []
misc/complex      complex64  [2, 2]

embedding tables (--table NAME=TENSOR takes the first column):
  TABLE     ROWS  DIM  DTYPE     KIND                             SLOTS
  emb/item  6     8    float32   variable                         m=emb/item/Adam, v=emb/item/Adam_1
  emb/tag   5     4    bfloat16  variable                         -
  emb/user  10    4    float32   partitioned variable (3 slices)  accumulator=emb/user/Adagrad
"""


# a Keras model saved with tf.train.Checkpoint: names from the object graph, the Dense kernel apart
KERAS_CHECKPOINT_LS = (FIX / "keras_checkpoint_ls.txt").read_text()  # `tf ls` of it, word for word


def test_cli_ls():
    res = dynemb("tf", "ls", "tests/fixtures/tf/tf1_saver", keep_carriage_returns=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout == TF1_LS
    res = dynemb("tf", "ls", "tests/fixtures/tf/tfra_tf1/model", keep_carriage_returns=True)
    assert res.returncode == 0, res.stderr
    assert (
        "  user_de  7     4    float32  TFRA table (2 shards)  m=user_de_Adam_m (2 shards, matched by key), "
        "v=user_de_Adam_v (2 shards, matched by key)"
    ) in res.stdout.splitlines()
    assert "m/user_de_Adam_m_mht_2of2-values                         float32  [5, 4]  m slot of user_de" in res.stdout
    res = dynemb("tf", "ls", "tests/fixtures/tf/keras_model/model.keras", keep_carriage_returns=True)
    assert "optimizer/vars/2           float32  [11, 4]  accumulator slot of user_emb" in res.stdout
    res = dynemb("tf", "ls", "tests/fixtures/tf/keras_checkpoint", keep_carriage_returns=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout == KERAS_CHECKPOINT_LS


def test_cli_migrate_into_a_ps_and_into_files(embedded_ps, embedded_client, tmp_path):
    user, item = unique("user"), unique("item")
    tables = ["--table", f"{user}=emb/user,offset=100", "--table", f"{item}=emb/item"]
    res = dynemb(
        *"tf migrate tests/fixtures/tf/tf1_saver --optimizer adagrad --state-init 0.5 --quiet --ps".split(),
        embedded_ps.address,
        *tables,
        keep_carriage_returns=True,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"migrated emb/user (10 rows x 4, adagrad state from slots: accumulator=emb/user/Adagrad) -> PS table {user}",
        f"migrated emb/item (6 rows x 8, adagrad state from slots: none) -> PS table {item}",
    ]
    assert f"note: no accumulator slot for '{item}' in the checkpoint: its state starts at 0.5" in res.stderr
    assert f"note: '{item}': slot(s) m, v not kept (optimizer adagrad has no use for them)" in res.stderr
    for name, known, offset in (
        (user, FIXTURES["tf1_saver"]["emb/user"], 100),
        (item, FIXTURES["tf1_saver"]["emb/item"], 0),
    ):
        ids, emb, state = expected(known, "adagrad", state_init=0.5, offset=offset)
        assert np.array_equal(embedded_client.pull(name, ids).rows, np.concatenate([emb, state], axis=1))

    res = dynemb(
        *"tf migrate tests/fixtures/tf/keras_weights/model.weights.h5 --optimizer adam --table user=user_emb".split(),
        "--out",
        str(tmp_path),
        keep_carriage_returns=True,
    )
    assert res.returncode == 0, res.stderr
    assert "migrate user" in res.stderr  # the progress bar
    assert_rows_equal(read_folder(tmp_path / "user"), expected(FIXTURES["keras_weights"]["user_emb"], "adam"))
    res = dynemb(
        "checkpoint",
        "import",
        str(tmp_path / "user"),
        "--as",
        unique("k"),
        "--ps",
        embedded_ps.address,
        keep_carriage_returns=True,
    )
    assert res.returncode == 0, res.stderr

    res = dynemb(
        *"tf migrate tests/fixtures/tf/tf1_saver --optimizer sgd --table x=misc/complex --out".split(),
        str(tmp_path),
        keep_carriage_returns=True,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "dynemb: error: table 'x' (misc/complex): dtype complex64; an "
        "embedding must be a float tensor (float32, float64, float16, "
        "bfloat16)"
    )
    res = dynemb(
        "tf",
        "migrate",
        "tests/fixtures/tf/tf1_saver",
        "--table",
        "x=emb/user",
        "--out",
        str(tmp_path),
        keep_carriage_returns=True,
    )
    assert res.returncode == 2 and "--optimizer" in res.stderr


def screen(text: str) -> list[str]:
    """What a terminal shows of TEXT: each line as its carriage returns left it overwritten."""
    shown = []
    for line in text.split("\n"):
        row = ""
        for part in line.split("\r"):
            row = part + row[len(part) :]
        shown.append(row.rstrip())
    return shown


def test_cli_errors_name_real_flags_and_leave_no_progress_bar(tmp_path, tf1_copy):
    out = str(tmp_path / "out")
    migrate = ("tf", "migrate", str(tf1_copy), "--optimizer", "sgd", "--out", out, "--table", "a=emb/item")
    assert dynemb(*migrate, "--quiet", keep_carriage_returns=True).returncode == 0
    res = dynemb(*migrate, keep_carriage_returns=True)
    assert res.returncode == 1
    assert screen(res.stderr)[-2:] == [
        f"dynemb: error: {out}/a: already holds table files; choose another --out or give --overwrite",
        "",
    ]
    res = dynemb(
        "tf",
        "migrate",
        str(tf1_copy),
        "--out",
        out,
        *"--optimizer sgd --table a=emb/item --overwrite --quiet".split(),
        keep_carriage_returns=True,
    )
    assert res.returncode == 0, res.stderr

    # a corrupt tensor met while the verify bar is drawn: the error line shows the error alone
    data = corrupt_emb_user(tf1_copy)
    res = dynemb(
        "tf",
        "migrate",
        str(data),
        "--out",
        str(tmp_path / "new"),
        *"--optimizer sgd --table a=emb/item --table b=emb/user".split(),
        keep_carriage_returns=True,
    )
    assert res.returncode == 1 and "verify" in res.stderr  # the bar was drawn, then cleared
    assert [ln for ln in screen(res.stderr) if ln] == [ln for ln in screen(res.stderr) if ln.startswith("dynemb:")]
    assert screen(res.stderr)[-2].startswith("dynemb: error: ") and "the data file is corrupt" in res.stderr


def test_a_failure_while_writing_clears_the_progress_bar(tmp_path, capsys):
    source = open_source(str(FIX / "tf1_saver"))
    plans = migrate.plan(source, [migrate.TableSpec.parse("t=emb/user")], "adagrad")
    read = plans[0].source.values.read

    def failing(lo: int, hi: int) -> np.ndarray:
        if lo >= 4:
            raise TFMigrationError("the disk is full")  # stands for any error of a later chunk
        return read(lo, hi)

    plans[0].source.values.read = failing
    with pytest.raises(TFMigrationError, match="the disk is full"):
        migrate.to_files(tmp_path, plans, source, rows_per_shard=4, chunk_rows=4, progress=True)
    err = capsys.readouterr().err
    assert "migrate t" in err and not any(screen(err))  # drawn, then nothing left on screen


def test_every_flag_a_message_names_is_a_real_flag():
    """A message that names a flag must name one the parser has (not `overwrite` for --overwrite)."""
    import argparse
    import ast
    import re

    from dynemb.tf import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    commands = parser._subparsers._group_actions[0].choices["tf"]._subparsers._group_actions[0].choices
    flags = {f for p in commands.values() for a in p._actions for f in a.option_strings}
    named = set()
    for path in Path(cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named |= {(f, path.name) for f in re.findall(r"(?<![\w-])--[a-z][a-z-]*", node.value)}
    assert {"--overwrite", "--table", "--dtype"} <= {f for f, _ in named}
    assert sorted((f, where) for f, where in named if f not in flags) == []
