"""The table interpreter: one `lax.scan` over the ticks of a schedule.

At tick t, device k runs the tasks of the table's lanes in order (lanes.py),
dispatched on their op (`Op.F`: the forward, `Op.BW`: the fused backward,
`Op.B` and `Op.W`: zero bubble's input and weight gradients; each a loop of
0 or 1 trips, masked when the task is idle or its micro-batch does not
exist) on the task's virtual stage j (`Placement`), a branch of the stage switch
(branches.py); then all devices exchange activations and gradients outside
the switch (messages.py: collectives never sit in its branches; each runs
in a conditional every device takes alike, at the ticks the table sends
along its pairs), after the tick's last op (op_loops.py: every op's loop
hands the messages on).
What a backward does with its gradient is chosen once per program
(gradients.py): a synchronous table sums it; an asynchronous one applies
the stage's optimizer at once, inside the op, or, when the update runs
collectives, right after the op's loop on every device. A stage whose
optimizer forecasts its weights runs its forward on the forecast its last
update made (`OptState.ahead`, carried from tick to tick) and its backward
on a backward forecast, if it has a backward horizon. Where the table runs
a micro-batch's forward and backward on the last stage in one tick
(`Schedule.fused`: every tick at K = 1), the pair runs as one vjp that keeps
nothing, as a plain micro-batched jit does, and so does a synchronous
table's backward on a last stage that keeps nothing, whose forward's own
tick then runs nothing (last_stage.py: B runs the pair's split); a
synchronous table whose every op runs at every tick runs its ops without
the loops. A stage sharded over F devices (compile/fsdp.py) gathers its
weights before the tick's ops and scatters each backward's gradient in its
op (or both once a pass). The program does not grow with the number of
micro-batches or ticks. Zero bubble's B
and W are split_ops.py's; what a pass takes, carries and returns is
table_state.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pipejax.compile import branches, messages
from pipejax.compile.build import Build
from pipejax.compile.fsdp import ShardedWeights
from pipejax.compile.gradients import GradientPolicy
from pipejax.compile.last_stage import pairs
from pipejax.compile.lanes import TickTask, compiled_lanes, lane_rows, read_task
from pipejax.compile.metrics import last_stage_cells, loss_ticks
from pipejax.compile.op_loops import OpLoops
from pipejax.compile.optimizer import StageOptimizers
from pipejax.compile.spmd import gather, scatter, stage_index
from pipejax.compile.split_ops import SplitBackwardOps
from pipejax.compile.table_state import Ops, TableIn, TableOut, TickContext
from pipejax.packing import Buffers
from pipejax.mesh import STAGE
from pipejax.schedules import NONE, Op
from pipejax.schedules.tasks import BACKWARD


class _Tick:
    """The body of the scan: what stage k does at one tick. Its parts, each
    made from the `TickContext` every op reads: the ops' loops (`OpLoops`),
    the weights they run on (`ShardedWeights`: gathered where sharded) and
    zero bubble's B and W (`SplitBackwardOps`)."""

    def __init__(self, build: Build, opts: StageOptimizers | None, inp: TableIn,
                 whole: Buffers | None = None):
        """`whole`: a sharded stage's weights, gathered once before the pass
        (`Gather.STEP`); None to gather them at each tick (or unsharded)."""
        self.code, self.layout, self.opts = build.code, build.layout, opts
        self.F, self.sharded = build.F, build.stage.sharded
        self.placement, self.sync = build.placement, build.schedule.synchronous
        self.messages = build.schedule.messages
        self.S = self.placement.chunks
        self.lanes = compiled_lanes(build.schedule)
        self.k = stage_index()
        self.x, self.y = inp.data
        self.counters = inp.counters
        self.key = inp.key
        self.random = bool(build.code.plan.random_layers)
        # With v chunks a device, a synchronous backward adds its chunk's
        # gradients into the sum's own slots, in place (`StageGroups.run`),
        # instead of a whole device's gradient, zero but for one chunk.
        # A sharded stage gathered at each tick scatters a backward's whole
        # gradient to its pieces first: no chunk's slots to add into.
        scatter = self.F if self.sharded and whole is None else 1
        self.per_chunk = self.sync and self.placement.virtual > 1 and scatter == 1
        made = {Op.F: branches.forward, Op.B: branches.input_grad,
                Op.BW: functools.partial(branches.backward, into_sum=self.per_chunk),
                Op.W: functools.partial(branches.weight_grad, into_sum=self.per_chunk)}
        self.branches = {lane.op: made[lane.op](self.code) for lane in self.lanes}
        self.gradients = GradientPolicy(self.sync, opts, self.layout.pieces if scatter > 1
                                        else self.code.params, scatter,
                                        build.M if self.layout.versions else 0)
        # Which loops a tick runs, known from the table: the forward's and
        # the backward's (`separate`: a forward that is neither fused nor
        # run by its backward, last_stage.py), the fused pair's (`fusion`).
        schedule = build.schedule
        fused, forwards = schedule.fused, schedule.fwd != NONE
        self.fusion, self.deferred = bool(fused.any()), build.code.deferred
        inside = (last_stage_cells(schedule, (Op.F,)) != NONE) if self.deferred else fused
        self.separate = bool(forwards.sum() > inside.sum())
        # Every loop runs at every tick: a synchronous table with no idle cell
        # and no lane that mixes ops (K = 1 under GPipe and 1F1B).
        self.busy = (self.sync and bool((build.schedule.ops != Op.IDLE).all())
                     and not any(lane.mixed for lane in self.lanes))
        context = TickContext(self.code, self.layout, opts, self.gradients, self.branches,
                              self.per_chunk, self.busy, self.sharded, whole)
        self.loops = OpLoops(self.layout, self.busy)
        self.gathers = ShardedWeights(context)
        self.split = SplitBackwardOps(context, self.loops, self.gathers, self._inputs)

    def _inputs(self, g: jax.Array, j: jax.Array) -> tuple:
        """(x_m, y_m, key, first layer of j) of micro-batch g on virtual stage j;
        the key folded only where a layer draws from it (an op's loop ties its
        operands to its trips: XLA kept an unused key's fold-in at every op)."""
        slot = g % self.layout.data_slots
        pick = lambda ring: jax.tree.map(lambda a: a[slot], ring)
        first = jnp.asarray(self.code.firsts, jnp.int32)[j]
        key = jax.random.fold_in(self.key, g) if self.random else self.key
        return pick(self.x), pick(self.y), key, first

    def __call__(self, carry: tuple, xs: tuple) -> tuple:
        p, s, rings, grad_sum, held, mail = carry
        row, busy = xs  # the tick's lanes, and which collectives carry a message
        tasks = self._tasks(row, self.k)
        runs, fused = pairs(tasks, self.S - 1, self.deferred, self.fusion)
        ops = Ops(p, s, grad_sum, rings, mail)  # a cell runs one of B and BW: both write back
        if self.sharded:
            ops = ops._replace(whole=self.gathers.gathered(runs, fused, ops, held))
        loss, skipped = jnp.zeros((), jnp.float32), jnp.int32(0)
        for op in (lane.op for lane in self.lanes):
            if op == Op.F:
                ops, loss = self._forward(runs[op], ops, loss)
            elif op == Op.BW:
                ops, loss, skipped = self._backward(runs[op], fused, ops, loss)
            elif op == Op.B:
                ops, loss = self.split.input_grad(runs[op], ops, loss)
            else:
                ops = self.split.weight_grad(runs[op], ops)
        rings = messages.exchange(ops.rings, self.layout, self.placement, self.k, ops.mail,
                                  messages.Sends(lambda k: self._senders(row, k), busy))
        makers = [tasks[op] for op in BACKWARD if op in tasks] if self.deferred else [tasks[Op.F]]
        last = functools.reduce(jnp.logical_or, [t.real & (t.j == self.S - 1) for t in makers])
        held = ops.whole[:len(held)] if held else ()
        mail = ops.mail if self.S > 1 else mail  # one chunk sends nothing: XLA drops the ops'
        return ((ops.params, ops.opt_state, rings, ops.grad_sum, held, mail),
                (jnp.where(last, loss, 0.0), last.astype(jnp.int32), skipped))

    def mail(self) -> tuple[Buffers, ...]:
        """What the scan carries for the tick's messages, on and back, one
        buffer each, or one for both where no device runs a forward and a
        backward at one tick (`Schedule.messages`, `messages.letter`): the
        buffers the last tick sent, which the ops write in place (a message
        of no op is dropped by its receiver, whatever it holds). Started
        from zeros at every tick, each message buffer was filled anew: one
        activation-sized copy a tick on every table."""
        return tuple(self.code.acts.zeros() for _ in range(self.messages))

    def _tasks(self, row: tuple, k: jax.Array) -> dict[Op, TickTask]:
        """Device k's task in each compiled lane at this tick (`row`)."""
        return {lane.op: read_task(row[lane.index], lane.op, k, self.placement, self.counters)
                for lane in self.lanes}

    def _senders(self, row: tuple, k: jax.Array) -> tuple[TickTask, TickTask]:
        """The tasks whose messages device k sends at this tick: its
        forward's and its backward's (B's or BW's)."""
        tasks = self._tasks(row, k)
        back = [tasks[op] for op in BACKWARD if op in tasks]
        return tasks[Op.F], back[0] if len(back) == 1 else messages.either(*back)

    def _forward(self, task: TickTask, ops: Ops, loss: jax.Array) -> tuple[Ops, jax.Array]:
        """Stage k's forward of micro-batch g on virtual stage j at its
        weights (or their forecast): keeps its residuals (and with weight
        stashing the weights it used) in its slot; returns the ops' state,
        with the message on written into its buffers, and the loss.

        The weights pass through the loop's carry, untouched: as an operand
        of the loop XLA would copy them at every tick (they live on into
        the backward), in the carry it updates them in place. The body hands
        them on through an optimization barrier: a carry it returns as it
        came XLA reads as the loop's input, gives the backward's loop that
        same buffer to update, and copies the weights twice a tick (both
        loops then own one; measured on PipeDream without weight stashing
        and PB)."""
        if not self.separate:
            return ops, loss
        slot = task.ring % self.layout.kept_slots
        p, s = ops.params, ops.opt_state
        ahead = self.opts is not None and bool(s.ahead)  # the forward runs on the forecast
        # A sharded stage stashes its piece of the weights, not the gathered whole.
        piece = (s.ahead if ahead else p) if self.sharded and self.layout.weight_stashing else None

        def forward(args, c, rings, mail, slots):
            w, loss = c
            inputs, stash = args
            # its step's version, double-buffered (a sharded stage gathered that one)
            run_on = w if self.sharded else self.gradients.weights(w, rings, task.g)
            kept, on, loss = self.code.groups.run(self.branches[Op.F],
                                                  (run_on, slots[0], inputs, slot),
                                                  (rings.kept, messages.letter(mail, 0), loss),
                                                  at=task.j)
            weights = tuple(b.at[slot].set(v) for b, v in zip(rings.weights, w if stash is None
                                                               else stash))
            return ((lax.optimization_barrier(w), loss),
                    rings._replace(kept=kept, weights=weights), messages.posted(mail, 0, on))

        first = ops.whole[0] if self.sharded else s.ahead if ahead else p
        (w, loss), ops = self.loops.run(Op.F, task, forward,
                                        (self._inputs(task.g, task.j), piece), (first, loss), ops)
        if not self.sharded:
            p, s = (p, s._replace(ahead=w)) if ahead else (w, s)
        return ops._replace(params=p, opt_state=s), loss

    def _backward(self, task: TickTask, fused: TickTask | None, ops: Ops,
                  loss: jax.Array) -> tuple[Ops, jax.Array, jax.Array]:
        """Stage k's fused backward (BW) of micro-batch g on virtual stage j
        at the current weights (their backward forecast, or the stashed
        ones), or, for a pair the table fuses (`fused`), the last stage's
        forward and backward in one vjp at the forward's weights (both
        forecasts coincide there: no update comes between, the horizons are
        equal and the delay 0). Then what the program does with the
        gradient (`GradientPolicy`: `take` in the loop, `after` outside
        it, where its collectives run on every device at every tick). Returns the ops' state
        (the message back written), the loss and 1 if the guard skipped the update."""
        ahead = self.opts is not None and bool(ops.opt_state.ahead)
        stash = self.layout.weight_stashing and not self.sharded

        def backward(micro, c, rings, mail, slots):
            p, s, carried, loss, skipped = c
            slot = task.ring % self.layout.kept_slots
            w = ops.whole[1] if self.sharded else messages.read(rings.weights, slot) if stash else (
                p if self.opts is None else self.gradients.weights(
                    self.opts.backward_weights(p, s), rings, task.g))
            args = (*slots, (rings.kept, slot), micro)
            if self.per_chunk:
                carried, back = self.code.groups.run(self.branches[Op.BW], (w, *args),
                                                     (carried, messages.letter(mail, 1)),
                                                     at=task.j)
                return (p, s, carried, loss, skipped), rings, messages.posted(mail, 1, back)
            grads, back = self.code.groups.switch_at(task.j, self.branches[Op.BW], w, *args)
            p, s, carried, rings, skipped = self.gradients.take(
                (p, s, carried, rings, skipped), grads, task.g)
            return (p, s, carried, loss, skipped), rings, messages.posted(mail, 1, back)

        def both(micro, c, rings, mail, slots):
            p, s, carried, _, skipped = c
            w = ops.whole[0] if self.sharded else self.gradients.weights(
                s.ahead if ahead else p, rings, fused.g)
            loss, grads, back = branches.fused(self.code, w, slots[0], micro)
            p, s, carried, rings, skipped = self.gradients.take(
                (p, s, carried, rings, skipped), grads, fused.g)
            return (p, s, carried, loss, skipped), rings, messages.posted(mail, 1, back)

        carry = (ops.params, ops.opt_state, self.gradients.carried(ops.grad_sum), loss,
                 jnp.int32(0))
        if self.separate:  # a slot exists: the table keeps residuals
            carry, ops = self.loops.run(Op.BW, task, backward, self._inputs(task.g, task.j),
                                        carry, ops)
        if fused is not None:  # its input is read as a forward's
            carry, ops = self.loops.run(Op.F, fused, both, self._inputs(fused.g, fused.j),
                                        carry, ops)
        p, s, carried, loss, skipped = carry
        grad_sum = carried if self.sync else ops.grad_sum
        if self.gradients.after_loop:
            real = task.real if fused is None else task.real | fused.real
            g = task.g if fused is None else jnp.where(fused.real, fused.g, task.g)
            p, s, rings, skipped = self.gradients.after(p, s, carried, ops.rings, real, g)
            ops = ops._replace(rings=rings)
        return ops._replace(params=p, opt_state=s, grad_sum=grad_sum), loss, skipped


def run_table(build: Build, inp: TableIn, opts: StageOptimizers | None = None) -> TableOut:
    """Inside shard_map: one pass over the table. `opts` are the per-stage
    optimizers an asynchronous table applies; losses are averaged over the
    mesh's batch axes (the data axes and `fsdp`)."""
    schedule, axes = build.schedule, build.axes
    ticks = loss_ticks(schedule, build.code.deferred)  # static
    whole = gather(inp.params, build.code.params) if build.stage.gathers_once else None
    sums = build.layout.pieces if whole is None else build.code.params  # the sum's packing
    grad_sum = sums.zeros() if schedule.synchronous else ()
    tick = _Tick(build, opts, inp, whole)
    # Each tick emits its loss (0 unless the last stage finished a micro-batch);
    # the static `ticks` then pick the M losses of this pass in id order.
    (p, s, rings, grad_sum, *_), (losses, done, skipped) = lax.scan(
        tick, (inp.params, inp.opt_state, inp.rings, grad_sum, tick.gathers.held(), tick.mail()),
        (lane_rows(schedule, tick.lanes), jnp.asarray(messages.carried(schedule))))
    if whole is not None:
        grad_sum = scatter(grad_sum, build.F, build.code.params)
    losses, done = lax.psum(losses, STAGE)[ticks], lax.psum(done, STAGE)[ticks] > 0
    counts = opts is not None and opts.outer.skip_nonfinite
    skipped = lax.psum(jnp.sum(skipped), (*axes, STAGE)) if counts else jnp.int32(0)
    if build.batch_axes:  # every replica (and piece) finishes the same micro-batches
        losses = lax.pmean(losses, build.batch_axes)
    return TableOut(p, s, rings, grad_sum, losses, done, skipped)
