"""The zero-bubble split of a stage's backward into B and W (Qi et al. 2024, §2).

A stage's backward maps (weights, input, residuals, output cotangent) to
(weight gradients, input gradient). Traced once as a jaxpr, its equations
fall in two parts: W, the weight gradients' own contractions and
reductions and what follows them (`_tails`), and B, the rest: the
cotangents' chain through the stage, and so the input gradient, what the
previous stage waits for (the first stage runs the chain in B too). B
runs its part and files the *bridge*, the fewest bytes of what only B's
tick has (the weight path's cotangents, what a rematerialized stage's
replay made) from which W makes what it reads (`_bridge`). W later runs
its part from the bridge and what it reads again where it lives: the
weights, the stage input, the micro-batch's feed and the forward's kept
residuals, running again the elementwise and layout equations between
those and its reads.
Every costly equation of the backward runs once, in B or in W, so B + W
cost what the fused backward costs and those equations (the naive split, a
second `jax.vjp` for W, replays the forward and loses to 1F1B: marin
#6532; on the zoo GPT the equations W runs again add 0.9 % to the
backward's FLOPs, `pipejax.bench.op_costs.op_counts`). Call-like equations
(jit, remat) are inlined first, so that a rematerialized stage's
replayed forward runs in B and W reads what it needs of it from the
bridge. Equations with sub-programs that are not calls (a `lax.scan`,
`cond` or `while` in a layer) stay whole: where one makes both gradients,
it runs in B and its weight gradients wait in the bridge for W (correct,
but no work is left for W to move). Equations with side effects
(callbacks) run in B.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.extend import core

from pipejax.compile.cut import min_vertex_cut
from pipejax.compile import dot_order
from pipejax.compile.residuals import costly

_INLINE = {"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "remat"}

Ref = Any  # an int (a value of the graph) or ("lit", value)


@dataclasses.dataclass(frozen=True)
class _Node:
    primitive: Any
    params: dict
    ins: tuple[Ref, ...]
    outs: tuple[int, ...]
    avals: tuple[Any, ...]  # the outputs' abstract values
    ctx: Any  # the equation's context (what `jax.core.eval_jaxpr` binds it under)
    effects: bool  # the equation has side effects (a callback): it runs, needed or not


def _flatten(jaxpr: Any, consts: Sequence[Any], ins: Sequence[Ref], nodes: list,
             count: list[int]) -> list[Ref]:
    """Append `jaxpr`'s equations to `nodes` (call-like ones inlined), its
    inputs bound to `ins`; returns its outputs' refs."""
    env: dict = dict(zip(jaxpr.invars, ins))
    env.update({v: ("lit", c) for v, c in zip(jaxpr.constvars, consts)})
    ref = lambda v: ("lit", v.val) if isinstance(v, core.Literal) else env[v]
    for eqn in jaxpr.eqns:
        args = [ref(v) for v in eqn.invars]
        inner = None
        if eqn.primitive.name in _INLINE:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if inner is not None:
            closed = isinstance(inner, core.ClosedJaxpr)
            outs = _flatten(inner.jaxpr if closed else inner, inner.consts if closed else (),
                            args, nodes, count)
        else:
            outs = list(range(count[0], count[0] + len(eqn.outvars)))
            count[0] += len(outs)
            nodes.append(_Node(eqn.primitive, eqn.params, tuple(args), tuple(outs),
                               tuple(v.aval for v in eqn.outvars), eqn.ctx,
                               bool(eqn.effects)))
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = o
    return [ref(v) for v in jaxpr.outvars]


def _needed(nodes: Sequence[_Node], targets: Sequence[Ref], stop: set,
            effects: bool = False) -> list[int]:
    """Indices of the nodes that `targets` depend on (and with `effects` the
    nodes with side effects), not looking past the values in `stop`."""
    want = {r for r in targets if isinstance(r, int) and r not in stop}
    keep = []
    for i in range(len(nodes) - 1, -1, -1):
        if want.intersection(nodes[i].outs) or (effects and nodes[i].effects):
            keep.append(i)
            want.update(r for r in nodes[i].ins if isinstance(r, int) and r not in stop)
    return keep[::-1]


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """A backward's B and W parts over one flat list of inputs.

    `reread`: the inputs available again at W's tick (the weights, the stage
    input, the feed, the kept residuals); the other inputs W reads (the
    output cotangent) travel in the bridge. A bridge value is filed without
    its size-1 axes: filed as made, the per-token (4, 128, 1) values of the
    zoo GPT (depth 14, K = 1, remat "stage") got a layout of their own in
    the one-slot ring, copied at every tick (116 copies a tick)."""

    nodes: tuple[_Node, ...]
    inputs: int
    b: tuple[int, ...]  # node indices of B
    w: tuple[int, ...]  # node indices of W
    b_outs: tuple[Ref, ...]  # the input gradient's leaves
    w_outs: tuple[Ref, ...]  # the weight gradients' leaves
    bridge: tuple[int, ...]  # values B files for W
    reread: tuple[int, ...]  # inputs W reads itself
    avals: tuple[Any, ...]  # the bridge's ShapeDtypeStructs, filed without size-1 axes
    shapes: tuple[tuple[int, ...], ...]  # the bridge values' own shapes
    # W's contractions, each True where its operands run swapped (dot_order.py)
    dots: dict[int, bool] = dataclasses.field(hash=False)

    def run_b(self, flat: Sequence[Any]) -> tuple[list, list]:
        """(input gradient leaves, bridge values) from all the inputs."""
        env = dict(enumerate(flat))
        _run(self.nodes, self.b, env, {})
        return ([_read(env, r) for r in self.b_outs],
                [env[r].reshape(a.shape) for r, a in zip(self.bridge, self.avals)])

    def run_w(self, reread: Sequence[Any], bridge: Sequence[Any]) -> list:
        """The weight gradient leaves from the reread inputs (in input
        order) and the bridge."""
        env = dict(zip(self.reread, reread))
        env.update((r, v.reshape(shape)) for r, v, shape in zip(self.bridge, bridge, self.shapes))
        _run(self.nodes, self.w, env, self.dots)
        return [_read(env, r) for r in self.w_outs]


def _read(env: dict, r: Ref) -> Any:
    return r[1] if isinstance(r, tuple) else env[r]


def _run(nodes: Sequence[_Node], which: Sequence[int], env: dict,
         dots: Mapping[int, bool]) -> None:
    for i in which:
        node = nodes[i]
        params = node.primitive.get_bind_params(node.params)
        args = [_read(env, r) for r in node.ins]
        with node.ctx.manager:
            out = (dot_order.bind(node.primitive.bind, params, *args, dots[i]) if i in dots
                   else node.primitive.bind(*args, **params))
        env.update(zip(node.outs, out if node.primitive.multiple_results else [out]))


def _remakable(node: _Node) -> bool:
    """Whether W may run `node` again: elementwise or layout
    (`residuals.costly` says which), with no side effects."""
    return not node.effects and not costly(node.primitive, **node.params)


def _bridge(nodes: Sequence[_Node], b: Sequence[int], tails: set[int], w_outs: Sequence[Ref],
            reread: Sequence[bool], aval: dict) -> list[int]:
    """The values B files for W: the fewest bytes from which W makes what
    it reads (its own equations' inputs, the weight gradients it does not
    make), running again the equations it may (`_remakable`) on the bridge
    and on the inputs it reads itself (`reread`).
    A minimum cut (cut.py) between what only B makes (a costly equation's
    values, one with side effects, the inputs W does not read) and what W
    reads. Filing every value W reads that it cannot make from its own
    inputs held a layer norm's dy and dy·x̂ (W sums each) and an
    attention's dq before and after its heads' transpose: on the zoo GPT
    (depth 14, width 128, K = 4, M = 8, remat "none", `print(pipe)`)
    zb-h1's bridge slots, 4 a device, hold 9.3 MiB each where they held
    13.0: its rings 14.8 MiB less (zb-v's 13.9).
    The step time did not move on 2 CPU cores (over 1F1B's, alternated:
    zb-h1 1.111 before, 1.118 after; zb-v 1.008, 1.038; a run's noise is
    about 0.03): there B's write of a row and W's copy of it out (a matmul
    does not read a dynamic row in place) cost about what W's elementwise
    equations run again cost. Charging each value W makes again its bytes
    too (a cut of the bytes filed and remade) files 2.2 times the bytes
    (K = 4: 20.0 MiB a slot; K = 1: 71.7 against 32.4) and takes zb-h1 on
    one device from 1.11× to 1.03× 1F1B's step (`benchmarks/table_speed.py`:
    each of the stage's 14 layers makes the residual stream's sum again,
    and XLA fuses the sum into every operand that reads it), but not at
    K = 4 (1.15× without, 1.17× with), so the cut counts bytes filed alone."""
    made_by_w = {o for i in tails for o in nodes[i].outs}
    arcs, sources = [], [i for i, again in enumerate(reread) if not again]
    for i in b:
        node = nodes[i]
        if _remakable(node):
            arcs += [(r, o) for r in node.ins if isinstance(r, int) for o in node.outs]
        else:
            sources += node.outs
    reads = [r for i in tails for r in nodes[i].ins] + list(w_outs)
    sinks = {r for r in reads if isinstance(r, int) and r not in made_by_w}
    values = {r for arc in arcs for r in arc} | set(sources) | sinks
    weight = {r: max(1, aval[r].size * aval[r].dtype.itemsize) for r in values}
    return sorted(min_vertex_cut(arcs, weight, sources, sinks))


def _tails(nodes: Sequence[_Node], chain: set[int]) -> set[int]:
    """The nodes outside `chain` whose values reach the weight gradients
    through remade equations alone: the weight gradients' own contractions
    and reductions (a Dense's xᵀ·dy, a bias's Σ dy) and what follows them.
    W runs these; B runs the rest of the backward, the cotangents' chain
    through the stage, even where no input gradient needs it (the first
    stage, whose input is the data): else the first stage's W was its whole
    backward, and at the lock-step ticks of zb-h1 every other device waited
    for it (zoo GPT, depth 14, K = 4, remat "none": W 20.1 ms against 9.0 on
    the next stage, B 0.07 ms against 17.1)."""
    producer = {o: i for i, node in enumerate(nodes) for o in node.outs}
    readers: list[list[int]] = [[] for _ in nodes]
    for c, node in enumerate(nodes):
        for r in node.ins:
            if isinstance(r, int) and r in producer:
                readers[producer[r]].append(c)
    tails: set[int] = set()
    for i in range(len(nodes) - 1, -1, -1):
        if i not in chain and not nodes[i].effects and all(
                c in tails and _remakable(nodes[c]) for c in readers[i]):
            tails.add(i)
    return tails


def split_backward(fn: Callable, args: Sequence[Any], weights: int, reread: Sequence[bool]
                   ) -> SplitBackward:
    """Split `fn(*args)` -> (weight gradient leaves..., input gradient
    leaves...) (`weights` leaves first) over its flat `args`
    (ShapeDtypeStructs); `reread[i]` marks the inputs W gets again."""
    closed = jax.make_jaxpr(fn)(*args)
    nodes: list[_Node] = []
    count = [len(args)]
    outs = _flatten(closed.jaxpr, closed.consts, list(range(len(args))), nodes, count)
    w_outs, b_outs = outs[:weights], outs[weights:]
    chain = set(_needed(nodes, b_outs, set(), effects=True))  # a callback runs once, in B
    tails = _tails(nodes, chain)
    b_side = sorted(chain | {i for i in _needed(nodes, w_outs, set()) if i not in tails})
    aval = dict(enumerate(args))
    for node in nodes:
        aval.update(zip(node.outs, node.avals))
    bridge = _bridge(nodes, b_side, tails, w_outs, reread, aval)
    again = {i for i, r in enumerate(reread) if r}
    w = _needed(nodes, w_outs, set(bridge) | again)
    b = _needed(nodes, [*b_outs, *bridge], set(), effects=True)  # b_side less what W makes
    return SplitBackward(tuple(nodes), len(args), tuple(b), tuple(w), tuple(b_outs),
                         tuple(w_outs), tuple(bridge), tuple(sorted(again)),
                         tuple(jax.ShapeDtypeStruct(tuple(d for d in aval[r].shape if d != 1),
                                                    aval[r].dtype) for r in bridge),
                         tuple(aval[r].shape for r in bridge),
                         dot_order.orders(nodes, w, set(bridge) | again, aval))

