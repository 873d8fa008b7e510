"""Training tests: helpers beside this file (tabular_data.py) are importable by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
