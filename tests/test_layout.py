"""The package's layout rules, read from the source: module size, one-way imports, no import circles
(every import counts, lazy and type-only ones too)."""
import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("xla_lora_pass", "graph_rewrites")
MAX_LINES = 300


def _modules():
    """{dotted module name: path} for every module of the two packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path, top_level_only: bool):
    """The package modules ``name`` imports (resolved; ``from pkg import mod`` names the module when it is one).

    ``top_level_only``: leave out imports inside functions and ``if TYPE_CHECKING:`` blocks, which run late or
    never and so close no circle at import time.
    """
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    nodes = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
            elif isinstance(node, ast.If) and top_level_only:
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
    if top_level_only:
        visit(tree.body)
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
            continue
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module
        submodules = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES}
        out.update(submodules)
        if len(submodules) < len(node.names):  # names defined in ``target`` itself, not only its modules
            out.add(target)
    return {m for m in out if m.split(".")[0] in PACKAGES or m.split(".")[0] in ("torch", "sympy", "transformers",
                                                                                "peft", "torchtune", "loralib")}


# Every Python file of the repository: the package, the tests, the benchmarks.
ALL_FILES = sorted(str(p.relative_to(REPO)) for folder in PACKAGES + ("tests", "bench")
                   for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", ALL_FILES)
def test_no_module_is_over_the_line_limit(path):
    lines = len((REPO / path).read_text().splitlines())
    assert lines <= MAX_LINES, f"{path} has {lines} lines (> {MAX_LINES}): split it by role"


def test_graph_rewrites_imports_nothing_from_xla_lora_pass():
    for name, path in MODULES.items():
        if name.startswith("graph_rewrites"):
            bad = {m for m in _imports(name, path, top_level_only=False) if m.startswith("xla_lora_pass")}
            assert not bad, f"{name} imports {bad}"


def test_the_shape_code_knows_no_lora():
    """shapes/ reads FX values (graph_rewrites.fx_values: torch and sympy only) and nothing else of the project."""
    for name, path in MODULES.items():
        if name.startswith("xla_lora_pass.shapes"):
            project = {m for m in _imports(name, path, top_level_only=False) if m.split(".")[0] in PACKAGES}
            allowed = {m for m in project if m.startswith("xla_lora_pass.shapes")} | {"graph_rewrites.fx_values"}
            assert project <= allowed, f"{name} imports {project - allowed}"
            assert not {m for m in _imports(name, path, False) if m.split(".")[0] in ("peft", "transformers")}


def test_no_import_circles():
    graph = {name: {m for m in _imports(name, path, top_level_only=False) if m in MODULES and m != name}
             for name, path in MODULES.items()}
    state, stack, cycles = {}, [], []

    def walk(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                # A module importing its own package's __init__ (which imports it) is how packages re-export.
                if not (len(cycle) == 3 and (cycle[0].startswith(cycle[1] + ".") or cycle[1].startswith(cycle[0] + "."))):
                    cycles.append(" -> ".join(cycle))
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert not cycles, "import circles:\n" + "\n".join(cycles)
