"""One family for everything the library raises on purpose.

``ost.Error`` is its root: ``except ost.Error`` catches every condition we
detect and word (a bad checkpoint, a bad argument, a busy location, a failed
peer), and nothing else (a bug of ours still surfaces as the builtin it is).
Each member also keeps the builtin base a user would catch without knowing the
library: a rejected checkpoint is a ``ValueError`` (as in ``safetensors``), a
missing file a ``FileNotFoundError``, a missing tensor a ``KeyError``, a busy
location or a failed peer an ``OSError``, an argument of the wrong type a
``TypeError``.

A checkpoint finding always names the file, and the tensor when one is
involved (``located``). ``Error``'s docstring draws the family.
"""

from __future__ import annotations

import dataclasses
import errno
import json


class Error(Exception):
    """The root of everything orbax_safetensors raises on purpose: ``except ost.Error``
    catches each condition the library detects and words, and no bug. Each member is also
    the builtin a user would catch without knowing the library (in parentheses)::

        Error
        ├── ArgumentError (ValueError)            a call that cannot be honoured as asked
        ├── ArgumentTypeError (TypeError)         an argument of the wrong type
        ├── SafetensorsError (ValueError)         a file, index or request against the rules
        │   ├── MissingFileError (FileNotFoundError)
        │   ├── MissingTensorError (KeyError)
        │   ├── ChecksumError
        │   └── CheckpointChangedError            kept changing under a load, on every attempt
        ├── MappingError (ValueError)             names or shapes a mapping cannot map
        ├── CheckpointBusyError (OSError)         another live writer holds the location
        ├── LocationTakenError (FileExistsError)  a save would replace what it may not
        ├── DistributedError (OSError)            processes of one operation failed
        │   └── PeerFailedError
        ├── PeerTimeoutError (TimeoutError)       a process never reached a step the others did
        ├── DistributedSetupError (RuntimeError)  several processes, no jax.distributed client
        ├── StorageError (OSError)                storage that failed after every retry
        ├── AccessDeniedError (PermissionError)   a location that refuses these credentials
        ├── UnreachableError (ConnectionError)    a remote that did not answer, with no cached copy
        ├── ReadOnlyLocationError (OSError)       a write to a location we only read (hf://)
        ├── ProtocolError (RuntimeError)          a step of our own protocol did not hold
        ├── MissingDependencyError (ImportError)  an optional package a URL or feature needs
        └── UnsupportedOrbaxError (ImportError)   Orbax outside the supported range
    """


class ArgumentError(Error, ValueError):
    """A call the library cannot honour as asked: an option out of range, arguments that
    contradict each other, a target that does not fit the checkpoint's tree."""


class ArgumentTypeError(Error, TypeError):
    """An argument of a type the call does not take."""


class ProtocolError(Error, RuntimeError):
    """A step of the library's own protocol did not hold: a block no process wrote, a planned
    header that does not hold its checksums, a checksum block a load read only in part. A bug
    (ours, or a peer process that broke the protocol), never a user's input; nothing is
    committed or returned when it is raised."""


class SafetensorsError(Error, ValueError):
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


class CheckpointChangedError(SafetensorsError):
    """The checkpoint was replaced or rewritten under a load on every attempt to read one
    version of it whole; a load never mixes two versions, so it gives up instead."""


class MappingError(Error, ValueError):
    """A name no rule maps, one several rules map, or shapes a rule cannot map."""


class CheckpointBusyError(Error, OSError):
    """Another live writer holds the location: one writer per checkpoint at a time."""

    def __init__(self, path: str, holder: str):
        super().__init__(errno.EBUSY, f"another save is writing this checkpoint ({holder})", path)
        self.holder = holder


class LocationTakenError(Error, FileExistsError):
    """The location holds what a save may not replace: a checkpoint (without
    ``overwrite=True``), safetensors files no save of ours wrote, or a directory or special
    file where a file goes. ``errno`` EEXIST, ``filename`` the path."""

    def __init__(self, message: str, path: str):
        super().__init__(errno.EEXIST, message, path)


class MissingDependencyError(Error, ImportError):
    """An optional package a URL scheme or feature needs is not installed; the message says
    which and how to install it."""


class DistributedSetupError(Error, RuntimeError):
    """Several JAX processes, but no ``jax.distributed`` client to agree through: call
    ``jax.distributed.initialize()`` first."""


class PeerTimeoutError(Error, TimeoutError):
    """A process never reached a step the others did (did every process call the
    operation, in the same order?)."""


class AccessDeniedError(Error, PermissionError):
    """The location refuses these credentials (a gated or private repository, a bucket the
    token may not read); the message says what to pass."""


class UnreachableError(Error, ConnectionError):
    """A remote that did not answer, where no local copy can stand in for it."""


class ReadOnlyLocationError(Error, OSError):
    """A write to a location the library only reads (``hf://``): refused before anything is
    written. ``errno`` EROFS, ``filename`` the URL."""

    def __init__(self, message: str, url: str):
        super().__init__(errno.EROFS, message, url)


class StorageError(Error, OSError):
    """A storage operation that still failed after every retry, or failed for good."""

    def __init__(self, message: str, *, url: str, code: int | None = None):
        self.url = url
        if code is None:
            super().__init__(message)
        else:  # errno and filename, as an OSError of the operating system has them
            super().__init__(code, message, url)


class UnsupportedOrbaxError(Error, ImportError):
    """The installed orbax-checkpoint is outside the range the integration supports."""


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


class DistributedError(Error, OSError):
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
