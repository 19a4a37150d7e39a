"""A plain function of one array as a layer (`nn.relu`, `jnp.tanh`, a flatten lambda).

It has no variables ({}), draws no random numbers and keeps no state; two
entries are one layer only when they are the same function object (equal
code in two lambdas is not provably one function).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from pipejax.layers.base import Layer, Variables


def function_name(fn: Any) -> str:
    """The function's `__name__` ('lambda' for a lambda), else its type's name."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "lambda" if name == "<lambda>" else name


@dataclasses.dataclass(frozen=True, eq=False)
class FunctionLayer:
    """One function of a layer list (module docstring)."""

    fn: Callable[[Any], Any]

    source = property(lambda self: self.fn, doc="The function.")
    name = property(lambda self: function_name(self.fn), doc="The function's name.")
    dtype = property(lambda self: getattr(self.fn, "dtype", None),
                     doc="A `dtype` attribute of the function, if any (None: as its inputs).")
    detail = ""

    def init(self, key: jax.Array, x: Any) -> Variables:
        """{}: a function has no variables."""
        return {}

    def initial_values(self) -> None:
        """None: nothing to start from."""
        return None

    def apply(self, variables: Variables, x: Any, key: jax.Array | None = None,
              train: bool = True) -> Any:
        """`fn(x)`."""
        return self.fn(x)

    def kept_state(self, variables: Any, x: Any, key: Any) -> None:
        """None: a function keeps no state."""
        return None

    def without_values(self) -> FunctionLayer:
        """Itself: it holds no parameters."""
        return self

    def same(self, other: Layer) -> bool:
        """The same function object."""
        return isinstance(other, FunctionLayer) and other.fn is self.fn

    def decoder(self) -> None:
        """None: nothing says whether a function computes each position alone."""
        return None
