import atexit
import os
import shutil
import sys
import tempfile
import zlib

import pytest

# Tests import their shared helpers (helpers.py, ct_oracle.py) from this directory.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole session, this process and every subprocess it starts (CLI
# runs, servers, deviceless plans): identical programs compile once. A fresh directory per session, never the
# user's ~/.cache (quantkit's own commands would otherwise turn that one on). Programs that compile in under
# half a second are not written: writing every eager op's executable made op-by-op code 13% slower (measured
# on gmm_v2.visits), and reading one back saves next to nothing.
# pytest-xdist workers inherit the directory of the session that started them.
_CACHE = os.environ.get("QUANTKIT_TEST_JAX_CACHE")
if _CACHE is None:
    _CACHE = os.environ["QUANTKIT_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="quantkit-test-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, True)
os.environ["QUANTKIT_JAX_CACHE"] = _CACHE
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"


def seed_of(name: str) -> int:
    """The seed of test `name`: crc32 of its node id, so that a failure reproduces on the next run."""
    return zlib.crc32(name.encode())


@pytest.fixture
def seed(request) -> int:
    """A seed fixed per test (crc32 of its node id, parameters included); tests put it in failure messages."""
    return seed_of(request.node.nodeid)


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="also run the exhaustive matrices (tests marked `exhaustive`; scripts/test.sh --exhaustive)")


def pytest_collection_modifyitems(config, items):
    """Tests marked `exhaustive` run only with --exhaustive (deselected otherwise, not skipped)."""
    if config.getoption("--exhaustive"):
        return
    keep = [i for i in items if i.get_closest_marker("exhaustive") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("exhaustive") is not None])
        items[:] = keep
