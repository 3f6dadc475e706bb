"""``python -m piper_train``: the ``piper`` command, as ``torchrun ... -m piper_train train`` runs it."""

import sys

from piper_train.cli import main

sys.exit(main())
