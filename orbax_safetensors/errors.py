"""The one exception type every rejection of a checkpoint raises.

Callers catch a single class (it is a ``ValueError``, so code written against
``safetensors`` keeps working) and still learn *where* the problem is: the
message always names the file, and the tensor when one is involved.
"""

from __future__ import annotations

import dataclasses
import errno
import json


class SafetensorsError(ValueError):
    """A file, index or request that does not follow the safetensors rules."""

    def __init__(
        self, message: str, *, file: str | None = None, tensor: str | None = None
    ):
        self.file = file
        self.tensor = tensor
        self.reason = message
        super().__init__(located(message, file, tensor))


class MissingFileError(SafetensorsError, FileNotFoundError):
    """A file the checkpoint needs is not there: a shard its index names (removed, or
    never copied along), or the ``*.safetensors`` file a path names.

    A ``FileNotFoundError`` (``errno`` ENOENT, ``filename`` the file), so code
    that handles a missing file catches it, and a ``SafetensorsError``, so code
    that handles a bad checkpoint does too.
    """

    def __init__(self, message: str, *, file: str, tensor: str | None = None):
        super().__init__(message, file=file, tensor=tensor)
        self.errno, self.strerror, self.filename = errno.ENOENT, message, file

    def __str__(self) -> str:
        return located(self.reason, self.file, self.tensor)

    def __reduce__(self):  # OSError's would call __init__ with (errno, strerror, filename)
        return _missing_file_error, (self.reason, self.file, self.tensor)


def _missing_file_error(message: str, file: str, tensor: str | None) -> MissingFileError:
    return MissingFileError(message, file=file, tensor=tensor)


class MissingTensorError(SafetensorsError, KeyError):
    """A target or mapping names tensors the checkpoint does not hold; the message lists
    every one of them.

    Also a ``KeyError``, the builtin a lookup by name raises, so code written
    against Orbax's ``SafetensorsLayout`` (which raises ``KeyError`` for a
    missing tensor) catches it; still a ``SafetensorsError`` (a ``ValueError``)
    like every other mismatch between a target and a checkpoint.
    """

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument (quoted); ours reads as the message.
        return Exception.__str__(self)


class SkippedLeavesWarning(UserWarning):
    """A ``load(..., strict=False)`` left target leaves out; the message names them (and
    ``LoadStats.skipped`` lists them all). ``warnings.simplefilter("error",
    ost.SkippedLeavesWarning)`` makes a partial restore fail instead."""


class ChecksumError(SafetensorsError):
    """Tensor bytes that do not match the crc32c their file stores: the file was damaged (on
    disk, in transit) or changed after it was written. Names the file, the tensor and the
    bytes."""


def located(message: str, file: str | None = None, tensor: str | None = None) -> str:
    """``message`` behind the file and tensor it is about: how every finding is worded."""
    where = ([f"file {file!r}"] if file else []) + ([f"tensor {tensor!r}"] if tensor else [])
    return f"{', '.join(where)}: {message}" if where else message


class CheckpointBusyError(OSError):
    """Another live writer holds the location: one writer per checkpoint at a time."""

    def __init__(self, path: str, holder: str):
        super().__init__(errno.EBUSY, f"another save is writing this checkpoint ({holder})", path)
        self.holder = holder


@dataclasses.dataclass(frozen=True)
class ProcessFailure:
    """What one process of a multi-process operation raised, as it crossed to the others."""

    process: int
    type: str
    errno: int | None
    filename: str | None
    message: str

    @classmethod
    def of(cls, process: int, error: BaseException) -> ProcessFailure:
        oserror = isinstance(error, OSError) and error.errno is not None and error.strerror
        return cls(process, type(error).__name__, getattr(error, "errno", None),
                   _filename(error), error.strerror if oserror else str(error))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> ProcessFailure:
        return cls(**json.loads(raw))

    def __str__(self) -> str:
        where = f": {self.filename!r}" if self.filename and self.filename not in self.message else ""
        return f"process {self.process}: {self.type}: {self.message}{where}"


class DistributedError(OSError):
    """Processes of one save failed; ``failures`` keeps each one's error (type, errno, file).

    Raised on every process of a multi-process operation, so they all stop
    together; on a process that failed itself, ``__cause__`` is its original
    exception. ``errno`` and ``filename`` are those of the first failure that has them.
    """

    def __init__(self, what: str, failures: dict[int, ProcessFailure]):
        ordered = [failures[p] for p in sorted(failures)]
        message = f"{what}: " + "; ".join(str(f) for f in ordered)
        first = next((f for f in ordered if f.errno is not None), None)
        if first is None:
            super().__init__(message)
        else:
            super().__init__(first.errno, message, first.filename)
        self.failures = failures


def _filename(error: BaseException) -> str | None:
    name = getattr(error, "filename", None) or getattr(error, "file", None)
    return None if name is None else str(name)


class PeerFailedError(DistributedError):
    """Another process of a collective load or save failed (``failures`` names each, with its
    error): this process stopped too, at once, rather than wait for it."""
