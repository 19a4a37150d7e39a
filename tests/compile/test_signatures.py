"""Signatures stay short where values can travel as one object: the compile
layer's functions take at most six parameters (a `Build`), the planner's at
most eight (a `Machine`, a `Space`, a `Training`)."""

import ast
import pathlib

import pytest

import pipejax.compile
import pipejax.planner


def _longer(package, most: int) -> list[str]:
    root = pathlib.Path(package.__file__).parent
    long = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.Lambda)):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
                count = len([n for n in names if n not in ("self", "cls")])
                if count > most:
                    long.append(f"{path.name}:{node.lineno} {getattr(node, 'name', 'lambda')} "
                                f"({count})")
    return long


@pytest.mark.parametrize("package,most", [(pipejax.compile, 6), (pipejax.planner, 8)])
def test_no_signature_takes_more_than_its_package_allows(package, most):
    long = _longer(package, most)
    assert not long, f"signatures over {most} parameters: {long}"
