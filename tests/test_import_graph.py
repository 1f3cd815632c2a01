"""The import graph reads like the architecture: no upward arrow, no loop.

Every import statement of the project's own modules (the top level and inside functions
alike) is an arrow. The top-level packages are layered; an arrow may only point to the same
layer or a lower one:

    protos, kv_transfer  <  engine_common  <  services  <  gateway  <  deploy

and ``tandem`` (the SDK) imports only ``protos``. Inside ``services`` the front end never
imports the replica, and neither does the gateway. The module graph has no cycle at run time:
an import under ``if TYPE_CHECKING:`` is an arrow for the layers but never runs, so it closes
no loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "kv_transfer", "engine_common", "services", "gateway", "deploy", "tandem")
LAYER = {"protos": 0, "kv_transfer": 0, "engine_common": 1, "services": 2, "gateway": 3,
         "deploy": 4}
GENERATED = ("protos/tandem/", "protos/third_party/")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")
            if not str(p.relative_to(REPO)).startswith(GENERATED)}


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes inside ``if TYPE_CHECKING:`` blocks (imported for annotations only)."""
    return {inner for node in ast.walk(tree)
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
            for statement in node.body for inner in ast.walk(statement)}


def _imports(path: Path, known: set[str], runtime_only: bool = False) -> set[str]:
    """The project modules ``path`` imports (a ``from package import name`` of a submodule
    counts as importing the submodule, not the package); with ``runtime_only``, not those imported for type
    checking only."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import submodule`` is an arrow to the submodule alone: the
            # package's ``__init__`` runs first, but the name comes from the submodule.
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            names = [name for name in submodules if name in known]
            if len(names) < len(submodules):  # a name defined in the module itself
                names.append(node.module)
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph(runtime_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known, runtime_only) - {name}
            for name, path in modules.items()}


def test_no_arrow_points_up() -> None:
    wrong = []
    for source, targets in _graph().items():
        top = source.split(".")[0]
        for target in targets:
            target_top = target.split(".")[0]
            if top == "tandem" and target_top not in ("tandem", "protos"):
                wrong.append(f"{source} -> {target} (the SDK imports only protos)")
            elif top in LAYER and target_top in LAYER and LAYER[target_top] > LAYER[top]:
                wrong.append(f"{source} -> {target}")
            elif top in LAYER and target_top == "tandem" and top != "deploy":
                wrong.append(f"{source} -> {target} (only deploy's commands use the SDK)")
    assert not wrong, "upward imports:\n" + "\n".join(sorted(wrong))


def test_the_front_end_and_the_gateway_never_import_the_replica() -> None:
    wrong = [f"{source} -> {target}" for source, targets in _graph().items()
             if source.startswith(("services.frontend", "gateway"))
             for target in targets if target.startswith("services.replica")]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_loop() -> None:
    graph = _graph(runtime_only=True)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (loop := visit(target)) is not None:
                return loop
        path.pop()
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (loop := visit(module)) is not None:
            raise AssertionError("import loop: " + " -> ".join(loop))
