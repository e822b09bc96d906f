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

# XLA:CPU without LLVM's optimization passes, here and in every subprocess: the tests' programs are tiny, and
# compiling them is most of their time (a 2-layer model's step: 3.5 s -> 2.2 s; test_engine 106 s -> 90 s).
# bfloat16 logits come out bit for bit the same, float32 ones move in their last bits (a tiny Llama's logits:
# 1e-7 relative), far inside every tolerance here. libtpu's deviceless compiles ignore the flag (the same
# bytes and temporaries for Gemma-3-27B's plan).
# Tests that start processes with more CPU devices add their flag to these.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"


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


def tpu_attached() -> bool:
    """Whether JAX runs on a TPU here: never under JAX_PLATFORMS=cpu (the default above), so that the CPU
    suite never opens a backend to find out."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        return False
    import jax

    return jax.default_backend() == "tpu"


def pytest_collection_modifyitems(config, items):
    """Tests marked `exhaustive` run only with --exhaustive (deselected otherwise, not skipped); tests marked
    `tpu` are skipped, with the reason, where no TPU is attached; tests marked `slow` run first, so that the
    xdist workers end on short tests, at about the same time."""
    tpu = [i for i in items if i.get_closest_marker("tpu") is not None]
    if tpu and not tpu_attached():  # CI has no TPU: the lane runs where one is (scripts/test.sh --tpu)
        skip = pytest.mark.skip(reason="needs a TPU: scripts/test.sh --tpu runs the TPU lane on one (README)")
        for item in tpu:
            item.add_marker(skip)
    if not config.getoption("--exhaustive"):
        keep = [i for i in items if i.get_closest_marker("exhaustive") is None]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("exhaustive") is not None])
            items[:] = keep
    items.sort(key=lambda i: i.get_closest_marker("slow") is None)  # stable: collection order otherwise


# Tests whose module-scoped fixture is costly enough to run on one worker only: a module, or the tests of a
# module whose names start with a prefix (module::prefix). Their servers compile every step program of their
# buckets while they start (~40 s; the harmony server ~60 s, which each worker paid while its two tests
# were two units).
ONE_WORKER = {"tests/test_serve.py", "tests/test_structured.py", "tests/test_gpt_oss.py::test_harmony"}


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist: each test is a unit of work handed to whichever worker is free, except that the tests of
    a module or prefix in ONE_WORKER are one unit (xdist's own loadgroup marks do not take with pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((g for g in ONE_WORKER if nodeid.startswith(g if "::" in g else g + "::")), nodeid)

    return Scheduling(config, log)
