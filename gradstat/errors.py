"""The one exception family gradstat raises on purpose, and the warning it gives."""

from __future__ import annotations


class GradstatError(Exception):
    """Base of every error gradstat raises deliberately; its message is meant for the user."""


class NormTypeError(GradstatError, ValueError):
    """A norm type outside 2, inf, 1 and finite p > 0."""


class GradDtypeError(GradstatError, TypeError):
    """A gradient whose dtype the operation does not accept."""


class AttributeMismatchError(GradstatError, ValueError):
    """A parameter's attributes contradict its tensor (for example pad_length beyond the shard)."""


class GradientInputError(GradstatError, ValueError):
    """A gradient (or parameter) the operation cannot take as it is: a parameter given where
    gradients are expected, a gradient on the meta device, memory that cannot be scaled in
    place. The message names the tensor by its place in the list and its shape."""


class ClipArgumentError(GradstatError, ValueError, TypeError):
    """A ``max_norm`` or ``total_norm`` clipping cannot use: negative, not a number, a bool.

    A ValueError and a TypeError both, so callers catching either (as they did the raw errors
    such arguments used to raise) still catch it."""


class StatsGroupError(GradstatError, ValueError):
    """A stats group that this rank is not a member of: its statistic cannot reach this rank."""


class SnapshotError(GradstatError):
    """A snapshot that cannot be read or trusted; the message names the file and the problem."""


class PartialGradientError(GradstatError, ValueError):
    """A DTensor gradient that is Partial: still pending its reduction, it has no norm yet."""


class ArgumentError(GradstatError, ValueError):
    """An argument out of its range (a negative step, a warmup longer than its window)."""


class ArgumentTypeError(GradstatError, TypeError):
    """An argument of the wrong type (a string where a number goes)."""


class PeerTimeoutError(GradstatError):
    """Some ranks did not reach a collective of gradstat's own within its bounded wait; the
    message names them."""


class StoppedTogether(GradstatError):
    """An error that stopped every process of a launched run alike.

    One process's bad input reaches the others through an exchange, so they all raise it with
    the same message; process 0 says it (``quiet`` false) and the others leave without a word
    (``quiet`` true), once process 0 has stopped.
    """

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


class NativeKernelWarning(UserWarning):
    """The native C kernel cannot be built or loaded: gradstat falls back to PyTorch operations,
    same numbers, about 3x slower. Said once per process; silence it with
    ``warnings.filterwarnings("ignore", category=NativeKernelWarning)``, or turn the kernel off
    with ``GRADSTAT_NATIVE=0``."""


class DumpWarning(UserWarning):
    """Something a dump's files suggest but cannot prove (a Megatron wgrads dump whose shapes
    say another TP size than its files)."""


class ReplicaWarning(UserWarning):
    """Data-parallel replicas that cannot be matched: ranks whose lists lack different
    gradients and differ in length (see :mod:`gradstat.core.replicas`); each rank's statistic
    then stands for a replica's, the largest taken."""
