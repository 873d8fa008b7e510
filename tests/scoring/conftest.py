"""Scoring tests: the training tests' tiny-dataset writer (tests/training/tabular_data.py) is importable by name."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training"))
