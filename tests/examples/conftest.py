"""Tests of examples/: each runs an example the way its user would. Helpers beside this file
(examples_env.py) are importable by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
