"""Test configuration: 4 host devices for the sharding tests, float64 for the oracle, and the
`rng` fixture and `gpu` marker shared by every test file (helpers live in tests/helpers.py)."""

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=4"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    # XLA reads XLA_FLAGS once, when jax's backends start: this must run before jax is imported.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}".strip()

import secrets  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)  # the oracle runs the reference in float64
# Exact float32 products in the references and the stock modules (XLA would use TF32 on a GPU).
jax.config.update("jax_default_matmul_precision", "highest")

from helpers import on_gpu  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU)")


def pytest_collection_modifyitems(config, items):
    if on_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() is not 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A numpy Generator with a fresh random seed per test. The seed is printed (pytest shows it
    with a failure) and a failing case is replayed with JAXDNN_TEST_SEED=<seed>."""
    seed = int(os.environ.get("JAXDNN_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.nodeid}: JAXDNN_TEST_SEED={seed}")
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def devices():
    """The 4 CPU devices of the sharding tests (see _DEVICES_FLAG above)."""
    devs = jax.devices("cpu")[:4]
    if len(devs) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    return devs
