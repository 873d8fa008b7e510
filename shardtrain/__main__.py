"""``python -m shardtrain``: the same as the ``shardtrain`` command."""

import sys

from shardtrain.cli import main

sys.exit(main())
