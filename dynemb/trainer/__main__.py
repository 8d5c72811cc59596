import sys

from dynemb.trainer.cli import main

sys.exit(main())
