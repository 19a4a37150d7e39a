"""The one interface a layer of a list offers the rest of pipejax.

A user's list mixes Flax linen modules, Flax NNX modules and functions of
one array; each kind is wrapped once (linen.py, nnx.py, function.py) into an
object of this shape, so tracing, stage code, initialization and the
one-device simulators run any layer the same way.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax

Variables = Any  # linen: what `module.apply` takes; NNX: an nnx.State of its Params; {}: a function

SHARED = ("here each layer would train its own copy where Flax trains one (pj.pipeline ties "
          "them on synchronous schedules: a copy per stage, their gradients summed); give each "
          "layer its own module, or put the layers that share weights into one layer")


class Decoder(NamedTuple):
    """How a layer computes one new position from what it keeps of the
    earlier ones (a key/value cache), for `pj.generate(cache=True)`.

    `init(variables, x)`: the empty cache for inputs shaped like `x` (a
    whole window, `ShapeDtypeStruct`s): as many positions as it holds.
    `step(variables, cache, x)`: the output for `x`, one position `[B, 1,
    ...]` after those the cache holds, and the cache with it added."""

    init: Callable[[Variables, Any], Any]
    step: Callable[[Variables, Any, Any], tuple[Any, Any]]


class Layer(Protocol):
    """One entry of a layer list: a pure function of (variables, input)."""

    @property
    def source(self) -> Any:
        """The object the user listed (a module or a function)."""

    @property
    def name(self) -> str:
        """A short readable name for tables and errors: the class, or the function's name."""

    @property
    def dtype(self) -> Any:
        """The layer's own computation dtype (None: as its inputs); precision.py
        leaves the weights of such a layer as stored."""

    @property
    def detail(self) -> str:
        """What an error adds after the layer's name ('' or its parameters)."""

    def init(self, key: jax.Array, x: Any) -> Variables:
        """Initial variables for input `x` ({} for a function); a layer that
        arrives initialized (NNX) returns its current parameters."""

    def initial_values(self) -> Variables | None:
        """The parameters the layer arrives with (NNX), None when `init` makes them."""

    def apply(self, variables: Variables, x: Any, key: jax.Array | None = None,
              train: bool = True) -> Any:
        """The layer's output for `x`; `key` feeds its random streams when training."""

    def kept_state(self, variables: Any, x: Any, key: Any) -> str | None:
        """The state a training forward keeps or writes, which a pipeline
        would drop (BatchNorm statistics), as the rest of an error message
        after 'layer i (name)'; None for a stateless layer. Abstract values in."""

    def without_values(self) -> Layer:
        """The same function of (variables, input) holding none of the values
        it arrived with (NNX), which a process-wide memory may keep."""

    def same(self, other: Layer) -> bool:
        """Whether both are one function of (variables, input), so stages
        holding them may share one branch."""

    def decoder(self) -> Decoder | None:
        """Its decode step over a cache (decoding.py), None when it has none."""
