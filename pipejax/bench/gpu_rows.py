"""What the GPU section (gpu.py) measures: the GPT's sizes, the groups of
rows timed together (a compute dtype on a vocabulary) and the rows, each a
step and the row it is read against."""

from __future__ import annotations

import dataclasses

import pipejax as pj


@dataclasses.dataclass(frozen=True)
class Size:
    """The GPT and its batch: `micro` sequences of `context` tokens a
    micro-batch, M micro-batches a step."""

    depth: int
    width: int
    heads: int
    context: int
    vocab: int
    micro: int
    M: int
    repeats: int
    max_stages: int  # the deepest 1f1b row, when the machine has the devices
    dtypes: tuple[str, ...] = ("bfloat16", "float32")  # compute dtypes, one group each
    lm_vocab: int | None = None  # a language model's vocabulary: one more group, `LM_ROWS`

    def layers(self) -> list:
        return pj.models.gpt(self.depth, self.width, self.heads, self.context, self.vocab)


@dataclasses.dataclass(frozen=True)
class Group:
    """Rows timed together, alternated: one compute dtype on one vocabulary."""

    key: str  # the result's key: the dtype, with the vocabulary where it is not the size's
    dtype: str
    size: Size
    rows: tuple[str, ...] | None = None  # the steps it runs (`steps`' names); None: all


# The rows of the language model's group: the limit and the K = 1 pipelines
# a user reads against it.
LM_ROWS = ("plain jit", "1f1b remat=none", "1f1b remat=stage")


def groups(size: Size) -> list[Group]:
    """The section's groups: every row in each of `size.dtypes` on its own
    vocabulary, then `LM_ROWS` in bf16 on `lm_vocab`."""
    out = [Group(dtype, dtype, size) for dtype in size.dtypes]
    if size.lm_vocab is not None:
        out.append(Group(f"bfloat16 vocab={size.lm_vocab}", "bfloat16",
                         dataclasses.replace(size, vocab=size.lm_vocab), LM_ROWS))
    return out


# GPT-2 small's blocks (12 x 768, 12 heads, 1024 tokens) over bytes: 86 M
# parameters. 8 sequences a micro-batch (8192 tokens): one micro-batch's
# float32 step peaks at 16 GB on an H100, within any 40 GB device. Its
# language model group: GPT-2's vocabulary of 50257 padded to 50304 (a
# multiple of 64, as nanoGPT pads it), 163 M parameters with the untied head.
FULL = Size(depth=12, width=768, heads=12, context=1024, vocab=256, micro=8, M=4, repeats=20,
            max_stages=8, lm_vocab=50304)
# A GPT a CPU steps in milliseconds: every row's code path between GPU runs
# (float32 runs the same code as bf16, with another dtype).
SMOKE = Size(depth=2, width=32, heads=2, context=16, vocab=64, micro=2, M=2, repeats=2,
             max_stages=2, dtypes=("bfloat16",), lm_vocab=512)


@dataclasses.dataclass(frozen=True)
class Step:
    """A row's step: `pj.pipeline` arguments (None: the plain jit `plain`
    names in `plain_steps`), its devices and micro-batches (None: the
    size's M), and the row its time is read against (None: none)."""

    pipeline: dict | None
    K: int = 1
    M: int | None = None
    plain: str = "plain_microbatched"
    against: str | None = "plain jit"

    @property
    def limit(self) -> str:
        """The name the ratios to `against` go by: "plain" or its schedule."""
        return "plain" if self.against.startswith("plain") else self.against.split()[0]


def steps(devices: int, size: Size) -> dict[str, Step]:
    """The rows, in the order they are compiled."""
    deeper = {f"1f1b K={K}": Step({"schedule": "1f1b", "remat": "stage"}, K, 2 * K, against=None)
              for K in (2, 4, 8) if K <= min(devices, size.max_stages)}
    return {"plain jit": Step(None, against=None),
            "1f1b remat=none": Step({"schedule": "1f1b", "remat": "none"}),
            "1f1b remat=stage": Step({"schedule": "1f1b", "remat": "stage"}), **deeper,
            "gpipe remat=none": Step({"schedule": "gpipe", "remat": "none"}),
            "gpipe remat=stage": Step({"schedule": "gpipe", "remat": "stage"}),
            "plain jit per micro-batch": Step(None, plain="plain_per_microbatch"),
            "pb": Step({"schedule": "pb", "remat": "stage"},
                       against="plain jit per micro-batch"),
            "zb-h1 remat=none": Step({"schedule": "zb-h1", "remat": "none"},
                                     against="1f1b remat=none"),
            "zb-h1 remat=stage": Step({"schedule": "zb-h1", "remat": "stage"},
                                      against="1f1b remat=stage")}
