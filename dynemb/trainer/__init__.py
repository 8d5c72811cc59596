"""The reference training job: a DLRM behind dynamic tables (`dynemb train`,
`torchrun -m dynemb.trainer`), built on the library's public API (dynemb.tables)."""
