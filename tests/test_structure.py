"""The package's shape: no import cycle (type-only imports included), every
module outside compile/ reaches it through its front door only, the library
never imports the benchmark package, and no module is over 300 lines."""

import ast
import pathlib

import pipejax
import pipejax.compile
import pipejax.models

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


def _outside(package: str, itself: bool = False) -> dict[str, set[str]]:
    """What each module outside `package` imports of its modules (and of it, if `itself`)."""
    return {name: {m for m in used if m.startswith(package + ".") or itself and m == package}
            for name, used in _graph().items() if not name.startswith(package)}


def test_modules_outside_the_compiler_use_its_front_door():
    past = {name: sorted(used) for name, used in _outside("pipejax.compile").items() if used}
    assert not past, f"import from pipejax.compile, not its modules: {past}"


def test_the_compiler_lists_every_module_it_has():
    listed = pipejax.compile.__doc__
    missing = [p.stem for p in (ROOT / "compile").glob("*.py")
               if p.stem != "__init__" and f"`{p.stem}`" not in listed]
    assert not missing, f"compile/__init__.py's module map lacks {missing}"


def test_the_library_does_not_import_the_benchmarks():
    """The CLI's `bench` command runs them; nothing else of the library needs them."""
    users = {name: sorted(used) for name, used in _outside("pipejax.bench", itself=True).items()
             if used and name != "pipejax.cli"}
    assert not users, f"modules importing pipejax.bench: {users}"


def test_no_module_is_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONGEST}
    assert not long, f"modules over {LONGEST} lines: {long}"


def test_the_command_line_compares_no_model_name():
    """What a model is comes from its `pj.models.MODELS` entry, not its name."""
    names = set(pipejax.models.MODELS)
    found = []
    for path in (ROOT / "cli").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                words = {c.value for part in (node.left, *node.comparators)
                         for c in ast.walk(part) if isinstance(c, ast.Constant)}
                if words & names:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"model names compared: {found}"


def test_no_gather_mode_is_compared_as_a_string():
    """Where a sharded stage gathers is a `Gather`, never the word."""
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    "gather" in ast.unparse(part) for part in (node.left, *node.comparators)):
                if any(isinstance(c, ast.Constant) and c.value in ("tick", "step")
                       for part in (node.left, *node.comparators) for c in ast.walk(part)):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"gather modes compared as strings: {found}"
