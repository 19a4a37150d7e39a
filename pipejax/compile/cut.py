"""A minimum vertex cut of a graph of values, by maximum flow.

Zero bubble's bridge (split.py) is such a cut: the values B files for W
must separate what only B makes (a matmul's output, the output cotangent)
from what W reads, and the cheapest in bytes is the one to file. Each
value is split into an arc in -> out of its weight (filing it); the arcs
of the graph (an equation W can run again) and those from the sources and
into the sinks cannot be cut. Edmonds-Karp: shortest augmenting paths, so
it ends whatever the weights (bytes).
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable, Iterable, Mapping

_SOURCE, _SINK = ("source",), ("sink",)


def min_vertex_cut(arcs: Iterable[tuple[Hashable, Hashable]], weight: Mapping[Hashable, int],
                   sources: Iterable[Hashable], sinks: Iterable[Hashable]) -> set[Hashable]:
    """The vertices of least total `weight` (each ≥ 1; every vertex of
    `arcs`, `sources` and `sinks` has one) whose removal leaves
    no path along `arcs` from a source to a sink (a vertex that is both is
    in the cut). Of the minimum cuts, the one nearest the sinks: the fewest
    vertices on the sinks' side (for the bridge, what W makes again)."""
    infinite = sum(weight.values()) + 1
    residual: dict = collections.defaultdict(lambda: collections.defaultdict(int))

    def arc(a: Hashable, b: Hashable, capacity: int) -> None:
        residual[a][b] += capacity
        residual[b][a] += 0  # the reverse arc, nothing to give back yet

    for v, w in weight.items():
        arc(("in", v), ("out", v), w)
    for a, b in arcs:
        arc(("out", a), ("in", b), infinite)
    for v in sources:
        arc(_SOURCE, ("in", v), infinite)
    for v in sinks:
        arc(("out", v), _SINK, infinite)
    forward = lambda node: residual[node].items()
    while _SINK in (parent := _search(_SOURCE, forward)):
        path, node = [], _SINK
        while node != _SOURCE:
            path.append((parent[node], node))
            node = parent[node]
        flow = min(residual[a][b] for a, b in path)  # a vertex's weight: every path has one
        for a, b in path:
            residual[a][b] -= flow
            residual[b][a] += flow
    backward = lambda node: ((a, residual[a][node]) for a in list(residual[node]))
    reaches = _search(_SINK, backward)  # what still reaches the sink
    return {v for v in weight if ("out", v) in reaches and ("in", v) not in reaches}


def _search(start: Hashable, arcs: Callable) -> dict:
    """Breadth-first from `start` over the arcs with capacity left
    (`arcs(node)`: (next node, capacity) pairs): each node reached, with
    the node it was reached from."""
    parent = {start: None}
    queue = collections.deque([start])
    while queue:
        node = queue.popleft()
        for nxt, capacity in arcs(node):
            if capacity > 0 and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return parent
