"""How stale an asynchronous pipeline's updates are, and what to do about it.

The delay in effective steps, η/(1 − m)·D at the stage with the largest
delay D (Kosson et al. 2020, §3: an update of size b moves the weights by
about η/(1 − m) gradients); with `reference=(η, m, B)` the recipe is first
moved to the micro-batch by their eq. 9, which keeps η/(1 − m)/B per
example, so the delay is η/(1 − m)·D·b/B. `pj.search` ranks by it
(planner/).
"""

from __future__ import annotations

import numpy as np

from pipejax.errors import ConfigError
from pipejax.schedules import Schedule

# Up to this delay in effective steps an asynchronous pipeline with LWP_D +
# SC_D trains as well as synchronous SGD with momentum. In the
# configurations of `benchmarks/convergence.py` (`python
# benchmarks/planner.py --part staleness`): up to 0.31 (ResNet at K = 8, 16
# and 21, VGG at K = 8) it ends within 2 points of SGDM but at momentum 0
# (2.5 points: no velocity to forecast); at 0.42 and 0.88 it loses 23 and
# 15, so the flag is right in 8 of 9. PB alone is not judged by the delay
# alone: at 0.11 it loses 1.6 points on the ResNet and 20 on the VGG (the
# flag is right for it in 6 of 9). Any threshold in [0.31, 0.42) gives the
# same 8 of 9: the threshold is read off these runs, not predicted for
# them. The quadratic model (`pj.quadratic`)
# bounds the delay from above: delayed momentum SGD diverges along a
# direction of curvature λ once ηλ/(1 − m)·D passes about 1. It is SGD with
# momentum's: Adam's and Muon's normalized steps are not judged by it (AdamW
# under 2BW at η 1e-3, 0.01 by this measure, ends 10 % above synchronous
# AdamW with error feedback, `benchmarks/async_2bw.py`).
STABLE_DELAY = 0.35



def effective_delay(schedule: Schedule, microbatch: int, learning_rate: float | None,
                    momentum: float, reference: tuple[float, float, int] | None) -> float | None:
    """η/(1 − m)·D at the stage with the largest delay, for updates of
    `microbatch` examples: 0 for a synchronous table, None when neither a
    rate nor a reference is given."""
    if reference is not None and learning_rate is not None:
        raise ConfigError("give the update's learning_rate (and momentum) or a reference "
                          "recipe to move to it, not both")
    D = max(schedule.delays)
    if D == 0:
        return 0.0
    if reference is not None:
        eta, m, B = reference
        return eta / (1 - m) * D * microbatch / B
    if learning_rate is None:
        return None
    return learning_rate / (1 - momentum) * D


def advise(delay: float | None, microbatch: int, reference,
           mitigation: str | None = "lwp+sc") -> str:
    """One line: what to do about the candidate's staleness (`microbatch`:
    the examples of one update, over all replicas; `mitigation`: the recipe
    its family's tables take, `Family.mitigation`)."""
    if delay == 0:
        return "synchronous: no staleness"
    if delay is None:
        return "asynchronous: pass learning_rate= and momentum= (or reference=) to judge the delay"
    if delay <= STABLE_DELAY:
        return f"trains at this delay with mitigation({mitigation!r})"
    smaller = microbatch * STABLE_DELAY / delay  # the delay scales with the micro-batch (eq. 9)
    if reference is not None and smaller >= 1:
        size = 2 ** int(np.log2(smaller))
        return (f"delay {delay:.2f} > {STABLE_DELAY}: updates of {size} examples, the "
                f"reference moved to them by eq. 9, and mitigation({mitigation!r})")
    if reference is None:
        return (f"delay {delay:.2f} > {STABLE_DELAY}: the rate x{STABLE_DELAY / delay:.2g}, "
                f"or give reference= and take smaller updates with eq. 9")
    return f"delay {delay:.2f} > {STABLE_DELAY} even at micro-batch 1: use a synchronous schedule"
