"""Reading TensorFlow checkpoints without TensorFlow, and moving their embedding tables into
dynemb (`dynemb tf ls|migrate`).

    bundle.py      tensor bundles (.index + .data-NNNNN-of-NNNNN): TF1 Saver, TF2 and SavedModel
    sstable.py     the .index file's table format
    source.py      opens any supported path and finds its tables and their optimizer slots
    objects.py     TF2 object graphs: slot variables of TF2 / Keras optimizers, variables' names
    saver.py       TF1 Saver names: <var>/Adagrad, <var>/Adam, <var>/Adam_1
    tfra.py        TensorFlow Recommenders-Addons dynamic tables (-keys / -values, _mht_XofY)
    keras_h5.py    Keras .weights.h5 and .keras files
    migrate.py     tensors → PS tables or table files: ids, optimizer state, checks
    cli.py         the `dynemb tf` command
    errors.py      TFMigrationError, the one error raised
"""
