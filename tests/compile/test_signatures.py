"""The compile layer's functions take at most six parameters: values travel as a `Build`."""

import ast
import pathlib

import pipejax.compile

MOST = 6


def test_no_signature_in_compile_takes_more_than_six_parameters():
    root = pathlib.Path(pipejax.compile.__file__).parent
    long = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.Lambda)):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
                count = len([n for n in names if n not in ("self", "cls")])
                if count > MOST:
                    long.append(f"{path.name}:{node.lineno} {getattr(node, 'name', 'lambda')} "
                                f"({count})")
    assert not long, f"signatures over {MOST} parameters: {long}"
