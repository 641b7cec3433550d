"""Exception types shared by every stage of the pipeline.

Every error raised on bad input names the offending tensor, key or block and
says what to do about it. All of them derive from :class:`MegatronFP8Error` so
callers can catch the whole family at once.
"""

from __future__ import annotations


class MegatronFP8Error(Exception):
    """Base class of every error raised by megatron-fp8."""


class QuantInputError(MegatronFP8Error, ValueError):
    """A tensor handed to a quantizer has the wrong rank, dtype, or is empty."""


class NonFiniteError(MegatronFP8Error, ValueError):
    """A tensor holds NaN or Inf where a finite value is required.

    Attributes:
        name: tensor name when the caller supplied one, else ``None``.
        block: index of the first offending block, e.g. ``(row_block, col_block)``
            or ``(expert, row_block, col_block)``.
    """

    def __init__(self, message: str, *, name: str | None = None, block: tuple[int, ...] | None = None):
        super().__init__(message)
        self.name = name
        self.block = block


class ConfigError(MegatronFP8Error, ValueError):
    """A run configuration is malformed or inconsistent."""


class RecipeUnsupportedError(MegatronFP8Error, RuntimeError):
    """The requested FP8 recipe cannot run on this GPU / CUDA / TransformerEngine."""


class ManifestError(MegatronFP8Error, ValueError):
    """The FP8 manifest is stale, inconsistent with the weight stream, or unreadable."""


class RefitError(MegatronFP8Error, RuntimeError):
    """A refit failed; the engine keeps serving its last fully applied version."""


class TransportTimeoutError(RefitError, TimeoutError):
    """A peer did not answer within the transport's timeout."""


class RefitAbortedError(RefitError):
    """The sender gave up on a refit version mid-stream (e.g. a NaN weight); nothing of it was applied.

    Attributes:
        version: the abandoned refit version when known, else ``None``.
    """

    def __init__(self, message: str, *, version: int | None = None):
        super().__init__(message)
        self.version = version


class TransportClosedError(RefitError):
    """The other end of a refit transport closed it in an orderly way; no more buckets will come."""


class WeightStreamError(RefitError, ValueError):
    """A weight-stream item (refit or checkpoint) has an unknown name, a wrong shape/dtype or bad scales.

    Raised before anything is applied: the receiver keeps its previous weights.

    Attributes:
        name: the offending tensor's name, when there is one.
    """

    def __init__(self, message: str, *, name: str | None = None):
        super().__init__(message)
        self.name = name


class TransformerEngineMissingError(MegatronFP8Error, RuntimeError):
    """A TransformerEngine stand-in was used for real work on a machine without TE."""


class RefitRefusedError(RefitError):
    """The receiver did not commit a version the sender sent: it refused it, or rolled the engine back.

    Attributes:
        version: the refit version.
        outcome: ``"refused"`` (nothing applied), ``"rolled_back"`` (applied, failed, restored) or
            ``"not_serving"`` (applied, failed, not restorable: the engine refuses to generate).
        reason: the receiver's reason, naming the tensor or check.
    """

    def __init__(self, message: str, *, version: int, outcome: str, reason: str):
        super().__init__(message)
        self.version = version
        self.outcome = outcome
        self.reason = reason


class RefitRolledBackError(RefitError):
    """A version failed after its first write to the engine; the engine was restored to its last good version."""


class EngineNotServingError(RefitError):
    """The engine holds no good version (a failed refit could not be rolled back); commit a good version first."""


class DiskFullError(MegatronFP8Error):
    """A write failed because its filesystem is full, over quota or read-only; the message names the path, the bytes
    it needed and had, what was kept, and what to do (:func:`megatron_fp8.files.disk_guard`)."""


class UsageError(ConfigError):
    """A bad command-line argument or an unusable output folder: the CLI exits with code 2."""


class DynamicSamplingError(MegatronFP8Error, RuntimeError):
    """DAPO's dynamic sampling ran out of generation rounds before a step had enough samples whose group rewards vary
    (``grpo.dynamic_sampling_max_gen_batches``); the checkpoints of the completed steps are kept."""
