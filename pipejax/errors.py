"""Every error pipejax raises on bad input, defined in one place.

Each message names the culprit (layer, shape, setting) and the numbers, and
says what to do; callers catch the built-in base classes as usual.
"""


class PipejaxError(Exception):
    """Base class of pipejax's own errors."""


class ConfigError(PipejaxError, ValueError):
    """A setting of `pj.pipeline` (or a helper) is out of range or unknown."""


class LayerError(PipejaxError, ValueError):
    """A layer cannot be traced: wrong input shape, mutable state, bad type."""


class BatchError(PipejaxError, ValueError):
    """A batch does not fit the pipeline (size, shapes, micro-batches)."""


class DeviceError(PipejaxError, RuntimeError):
    """The devices or the mesh cannot hold the requested stages."""


class ScheduleError(ConfigError):
    """A schedule table is impossible (an op before its input exists) or
    does not fit the pipeline: a setting, so a ConfigError too."""


class DataError(PipejaxError, ValueError):
    """A data file is missing or malformed."""


class ArgumentTypeError(PipejaxError, TypeError):
    """An argument is of the wrong kind (not an optax transform, not staged parameters)."""


class CheckpointError(PipejaxError, ValueError):
    """A checkpoint is missing or does not fit the trainer it is restored into."""


class OptimizerError(ArgumentTypeError, ConfigError):
    """The optimizer given is not an optax transformation nor a function
    StageInfo -> transformation (a name, a class, a factory left uncalled):
    a setting of the wrong kind, so both an ArgumentTypeError and a ConfigError."""
