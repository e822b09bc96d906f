import os
import sys

# Tests import the oracle helpers (ct_oracle) from this directory.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
