"""Test session setup: compile logging stays quiet, the helpers are importable."""

import os
import sys

os.environ.setdefault("PYMLA_QUIET", "1")
sys.path.insert(0, os.path.dirname(__file__))
