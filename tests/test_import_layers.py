"""The layers of src/qsaserve import one way: the module import graph (every `import` and
`from ... import`, function-level ones included, `if TYPE_CHECKING:` blocks excluded) has no
cycle; ops/ imports neither models/, engine/ nor server/; parallel/ imports neither engine/ nor
models/; the engine asks models through models/interfaces.py, never hasattr/getattr, and only
the engine reaches into its model runner. Static: nothing is imported."""
import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "qsaserve"

def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> the qsaserve modules it imports (`from pkg import name` counts as importing
    pkg.name when that is a module, else pkg)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                graph[mod].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    name = f"{target}.{alias.name}"
                    if name in mods:
                        graph[mod].add(name)
                    elif target in mods:
                        graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (or a self-import)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(map(sorted, cycles(graph))) == [["a", "b", "c"], ["e"]]


def test_no_import_cycle():
    found = [sorted(c) for c in cycles(import_graph())]
    assert not found, found


# What each low layer may import from qsaserve (itself always): ops/ holds kernels and their
# references and needs nothing above it; layers/ composes ops for the models; parallel/ is what
# models call for collectives and sharding; cache/ is page geometry.
ALLOWED_IMPORTS = {
    "ops": {"ops", "errors"},
    "cache": {"cache", "errors"},
    "parallel": {"parallel", "cache", "ops", "errors"},
    "layers": {"layers", "ops", "cache", "parallel", "errors"},
}


def test_low_layers_import_downward_only():
    bad = sorted((m, t) for m, targets in import_graph().items() for t in targets
                 if _layer(m) in ALLOWED_IMPORTS and _layer(t) not in ALLOWED_IMPORTS[_layer(m)])
    assert not bad, bad


def test_engine_asks_models_through_the_interfaces():
    pattern = re.compile(r"\b(?:hasattr|getattr)\(\s*(?:self\.)?(?:model|runner)\b")
    bad = [f"{p.relative_to(SRC)}:{n}" for p in (SRC / "engine").rglob("*.py")
           for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, bad


def test_only_the_engine_reaches_into_the_runner():
    pattern = re.compile(r"executor\.runner\b|runner\.(?:model|kv_quant)\b")
    bad = [f"{p.relative_to(SRC)}:{n}" for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] != "engine"
           for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, bad
