"""What the examples' tests share: where the examples and this venv's commands are."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
# The project's own command, from the venv running the tests (what a user's crontab names).
SHARDTRAIN = os.path.join(os.path.dirname(sys.executable), "shardtrain")

