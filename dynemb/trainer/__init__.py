"""TorchRec training behind dynamic tables: the DLRM job (`dynemb train`, `torchrun -m dynemb.trainer`),
checkpoints, portable table files and TensorFlow migration (`tf/`)."""
