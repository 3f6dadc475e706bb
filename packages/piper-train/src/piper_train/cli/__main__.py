"""``python -m piper_train.cli``: the ``piper`` command."""

import sys

from piper_train.cli import main

sys.exit(main())
