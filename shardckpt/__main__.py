"""``python -m shardckpt``: the same command as the ``shardckpt`` console script."""

import sys

from ._cli import main

sys.exit(main())
