import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.txt from the current output (review the diff like code)")


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test module compiles from scratch: Dynamo's per-code caches (and their
    recompile limit) are not shared across modules; tests within one module may
    share a compiled model."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def xla_device():
    # A venv without torch_xla (torch 2.14's) runs every CPU test; the XLA ones cannot run there at all.
    torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: this test runs on XLA")

    return torch_xla.device()
