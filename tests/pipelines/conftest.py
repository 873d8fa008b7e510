"""Pipelines tests: helpers beside this file (shard_testdata.py) are importable by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
