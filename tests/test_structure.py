"""The package's shape: no import cycle (type-only imports included), the
facades reach compile/ through its front door only, and no module is over
300 lines."""

import ast
import pathlib

import pipejax

ROOT = pathlib.Path(pipejax.__file__).parent
LONGEST = 300


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every pipejax module `path` imports, anywhere in it (functions and
    `if TYPE_CHECKING:` blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name.startswith("pipejax")}


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        # A package's own __init__ importing its submodules is not a cycle edge back.
        graph[name] = {m for m in _imports(path) if m in paths and m != name
                       and not (path.name != "__init__.py" and m == package)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_modules_import_no_cycle_even_for_types():
    graph = _graph()
    graph["pipejax"] = set()  # the top-level package re-exports everything
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_facades_use_the_compiler_through_its_front_door():
    for facade in ("pipeline.py", "trainer.py"):
        used = {m for m in _imports(ROOT / facade) if m.startswith("pipejax.compile")}
        outside = {m for m in used if not m.startswith("pipejax.compile.programs")}
        assert not outside, f"{facade} imports {sorted(outside)}; go through compile/programs.py"


def test_no_module_is_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONGEST}
    assert not long, f"modules over {LONGEST} lines: {long}"
