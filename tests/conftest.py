import ast
import importlib.util
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

# Found without importing it: importing torch_xla changes Dynamo's settings for the whole process, so the
# suite imports it only in the tests that use it.  Installed but broken (built for another torch) is not
# absent: those tests then fail, they are not skipped.
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
XLA_REASON = "needs torch_xla, not installed here (pip install -e \".[xla]\" pins torch 2.9.0 + torch_xla 2.9.0)"
# Names a test's own code uses that mean it needs torch_xla: the module, or tests/xla_utils' compile counter.
XLA_NAMES = {"torch_xla", "xla_compiles"}
# Optional LoRA clients some tests build models with: a test needs one when its code names it, or when it is
# marked @pytest.mark.needs("torchtune").
OPTIONAL_CLIENTS = ("torchtune", "loralib")


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.txt from the current output (review the diff like code)")


def _imports_torch_xla_at_top_level(path) -> bool:
    """Whether the module at ``path`` imports torch_xla when imported (module level, or under a top-level
    if/try), read from its source without importing it."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError):
        return False  # let pytest report it
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.If, ast.Try)):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []) +
                         [s for h in getattr(node, "handlers", []) for s in h.body])
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch_xla" for a in node.names):
            return True
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch_xla":
            return True
    return False


class _ModuleNeedingXla(pytest.Module):
    """A test module that imports torch_xla at its top, where torch_xla is not installed: skipped whole, with
    the reason, instead of a collection error that stops the run."""

    def _getobj(self):
        raise pytest.skip.Exception(f"{XLA_REASON} (the module imports it)", allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if not HAS_XLA and _imports_torch_xla_at_top_level(module_path):
        return _ModuleNeedingXla.from_parent(parent, path=module_path)
    return None  # pytest's own Module


def _code_names(item) -> set:
    code = getattr(getattr(item, "function", None), "__code__", None)
    return set(code.co_names) if code is not None else set()


def _needs_xla(item) -> bool:
    """Marked ``xla`` by hand (a module about torch_xla: ``pytestmark = pytest.mark.xla``), using the
    ``xla_device`` fixture (directly or through another fixture), or naming torch_xla or xla_compiles."""
    return (item.get_closest_marker("xla") is not None or "xla_device" in getattr(item, "fixturenames", ())
            or bool(_code_names(item) & XLA_NAMES))


def pytest_collection_modifyitems(config, items):
    """Marks each test that needs torch_xla ``xla`` (skipped with the reason where it is not installed), and
    skips a test whose optional client is not installed, naming it."""
    for item in items:
        if _needs_xla(item):
            if item.get_closest_marker("xla") is None:
                item.add_marker(pytest.mark.xla)
            if not HAS_XLA:
                item.add_marker(pytest.mark.skip(reason=XLA_REASON))
        wanted = {m for mark in item.iter_markers("needs") for m in mark.args}
        wanted |= _code_names(item) & set(OPTIONAL_CLIENTS)
        missing = sorted(m for m in wanted if importlib.util.find_spec(m) is None)
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)}, not installed here "
                                                    f"(setup.py's test extra installs it)"))


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


@pytest.fixture(scope="session")
def device():
    """Where a test that is not about XLA runs: torch_xla's device where torch_xla is installed (the suite's
    main configuration), else the CPU."""
    if not HAS_XLA:
        return torch.device("cpu")
    import torch_xla

    return torch_xla.device()


@pytest.fixture(scope="session")
def inner(device):
    """The inner backend for ``make_backend(meta, inner=inner)`` beside the ``device`` fixture: None (the
    device's own, openxla) on XLA; on the CPU aot_eager, which runs the same rewritten graph without
    inductor's compile time (tests about inductor pass it themselves)."""
    return None if device.type == "xla" else "aot_eager"
