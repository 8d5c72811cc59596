"""`python -m dynemb.trainer`: what torchrun runs (dynemb/trainer/cli.py)."""

import sys

from dynemb.trainer.cli import main

sys.exit(main())
