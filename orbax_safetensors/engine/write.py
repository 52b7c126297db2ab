"""How a process's bytes reach the files of a save: three strategies, chosen once.

* ``InPlace`` -- the backend writes at offsets (local disks, NFS): process 0
  creates every file at its final size under its temporary name, then every
  process writes the ranges it owns straight into the shared files, in
  parallel, and flushes them. Nothing is gathered and no byte is written twice.
* ``InParts`` -- no offset writes but a server-side merge (GCS compose, S3
  multipart copy), or several processes: each process uploads its ranges as
  part objects; process 0 adds the headers and assembles each file from its
  parts on the server, so tensor bytes never pass through another process
  unless the store's part rules force it.
* ``Streamed`` -- each process writes whole files front to back: one process
  on a backend with neither (``memory://``), the distributed layout (each
  process's own files), and consolidation (files shared out round-robin).

``for_storage`` picks between the first two and the third for an hf save; the
other callers stream by nature. Every strategy's ``write`` ends in an
agreement between the processes and returns what the commit puts in place.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax

from orbax_safetensors.engine.coordination import gather_to_all
from orbax_safetensors.engine.operation import Operation
from orbax_safetensors.planning import (
    HEADER,
    FilePlan,
    Segment,
    Transfer,
    Transfers,
    Upload,
    WritePlan,
    plan_uploads,
)
from orbax_safetensors.storage import Storage
from orbax_safetensors.storage.commit import Commit

WRITE_CHUNK_BYTES = 64 << 20  # the largest single write request
_WRITE_THREADS = 8
_MAX_OBJECTS_PER_FILE = 64  # beyond this a process packs its small ranges of a file into one object
_SMALL_OBJECT = 4 << 20  # an object smaller than this costs more in requests than it moves
_VIEWS_PER_WRITE = 1024  # buffers per pwritev (Linux's IOV_MAX)

Payloads = Sequence[memoryview]  # the bytes of each shard a process writes, by Segment.target
Chunks = Callable[[FilePlan], Iterable[memoryview | bytes]]  # a file's bytes, front to back


@dataclasses.dataclass
class Written:
    """What this process wrote, and what the commit then puts in place."""

    files: list[str]  # every process's files, by name
    index: tuple[str, bytes] | None
    bytes_written: int = 0
    requests: int = 0
    files_written: int = 0


class Strategy(abc.ABC):
    """Moves this process's planned bytes into a save's files (not yet committed)."""

    @abc.abstractmethod
    def write(self, op: Operation, commit: Commit) -> Written:
        """Writes and agrees with the other processes; raises (on every process) on failure."""


def for_storage(storage: Storage, plan: WritePlan,
                owned: Callable[[], Sequence[tuple[str, Transfers]]],
                payloads: Callable[[], Payloads], streamed: Chunks) -> Strategy:
    """The strategy an hf save takes on ``storage``, from its declared capabilities.

    ``owned`` plans this process's byte ranges (``planning.owned_ranges``),
    ``payloads`` gives its shards' bytes, ``streamed`` a whole file's bytes.
    """
    capabilities = storage.capabilities
    if capabilities.offset_writes:
        return InPlace(plan, owned(), payloads)
    if capabilities.server_side_merge or jax.process_count() > 1:
        return InParts(plan, owned(), payloads)
    return Streamed(plan.files, streamed, lambda op: ([f.name for f in plan.files], plan.index))


def _begin(op: Operation, commit: Commit, **kwargs) -> None:
    """Process 0 makes the directory and marks the location before any file changes."""
    def begin() -> None:
        commit.storage.makedirs(commit.directory)
        commit.begin(**kwargs)
    op.on_primary("begun", begin)


def _views(segments: Iterable[Segment], payloads: Payloads, header: bytes = b"") -> list[memoryview]:
    return [memoryview(header) if target == HEADER else payloads[target][offset:offset + length]
            for target, offset, length in segments]


class InPlace(Strategy):
    """Shared files created at their final size; every process fills its own ranges."""

    def __init__(self, plan: WritePlan, owned: Sequence[tuple[str, Transfers]],
                 payloads: Callable[[], Payloads]):
        self.plan, self.owned, self.payloads = plan, owned, payloads

    def write(self, op: Operation, commit: Commit) -> Written:
        storage = commit.storage
        names = [f.name for f in self.plan.files]

        def create() -> None:
            storage.makedirs(commit.directory)
            commit.begin()
            for file in self.plan.files:
                op.check_cancelled()
                storage.create_sized(commit.temporary(file.name), file.size, file.header)

        op.on_primary("created", create, lambda: commit.discard(names))
        payloads = self.payloads()

        def write_range(file_name: str, request: Transfer) -> None:
            # Views a batch at a time: a range of strided shards holds a run per row of each,
            # and a memoryview per run for a whole 64 MB range costs more than its bytes.
            offset, segments = request.offset, list(request.segments)
            for start in range(0, len(segments), _VIEWS_PER_WRITE):
                op.check_cancelled()
                batch = segments[start:start + _VIEWS_PER_WRITE]
                storage.write_at(commit.temporary(file_name), offset, _views(batch, payloads))
                offset += sum(length for _, _, length in batch)

        files = sorted({name for name, _ in self.owned})

        def write_all() -> None:
            with op.executor(_WRITE_THREADS, "orbax_safetensors-write") as pool:
                pool.wait([pool.submit(write_range, name, r)
                           for name, transfers in self.owned for r in transfers])
                pool.wait([pool.submit(storage.sync, commit.temporary(name)) for name in files])

        op.run("written", write_all, lambda: commit.discard(names) if op.is_primary else None)
        return Written(names, self.plan.index, sum(len(p) for p in payloads),
                       sum(len(transfers) for _, transfers in self.owned), len(files))


class InParts(Strategy):
    """Part objects uploaded in parallel by their owners, merged server-side by process 0."""

    def __init__(self, plan: WritePlan, owned: Sequence[tuple[str, Transfers]],
                 payloads: Callable[[], Payloads]):
        self.plan, self.payloads = plan, payloads
        headers = self.plan.files if jax.process_index() == 0 else ()
        self.uploads = plan_uploads(owned, headers, max_objects_per_file=_MAX_OBJECTS_PER_FILE,
                                    small_object=_SMALL_OBJECT)

    def write(self, op: Operation, commit: Commit) -> Written:
        storage = commit.storage
        names = [f.name for f in self.plan.files]
        headers = {f.name: f.header for f in self.plan.files}
        payloads = self.payloads()
        _begin(op, commit)

        def upload(item: Upload) -> None:
            op.check_cancelled()
            views = [v for r in item.ranges
                     for v in _views(r.segments, payloads, headers.get(item.file, b""))]
            storage.write(commit.part(item.file, item.key), views)

        def upload_all() -> None:
            with op.executor(_WRITE_THREADS, "orbax_safetensors-upload") as pool:
                pool.wait([pool.submit(upload, item) for item in self.uploads])

        # (file, offset, length, object key, position in the object) of every range
        mine = [[u.file, r.offset, r.length, u.key, position]
                for u in self.uploads
                for r, position in zip(u.ranges, itertools.accumulate(
                    (r.length for r in u.ranges), initial=0))]
        error = None
        try:
            upload_all()
        except BaseException as e:
            error = e
        every = [tuple(p) for raw in gather_to_all(f"{op.key}/parts", json.dumps(mine))
                 for p in json.loads(raw)]
        part_objects = sorted({commit.part(file, key) for file, _, _, key, _ in every})
        op.agree("uploaded", error,
                 lambda: storage.discard(part_objects) if op.is_primary else None)

        def assemble() -> None:
            try:
                self._assemble(op, commit, every)
            except BaseException:
                storage.discard(part_objects)
                commit.discard(names)
                raise
            with op.executor(_WRITE_THREADS, "orbax_safetensors-cleanup") as pool:
                pool.map(storage.remove, part_objects)

        op.on_primary("merged", assemble)
        return Written(names, self.plan.index, sum(len(p) for p in payloads), len(self.uploads),
                       len({u.file for u in self.uploads}))

    def _assemble(self, op: Operation, commit: Commit, parts: list[tuple]) -> None:
        """Process 0: each file from its parts, server-side where each part is one object."""
        by_file = collections.defaultdict(list)
        for name, offset, length, key, position in parts:
            by_file[name].append((offset, length, commit.part(name, key), position))
        for file in self.plan.files:
            op.check_cancelled()
            spans = sorted(by_file[file.name])
            covered = sum(n for _, n, _, _ in spans)
            if covered != file.size or any(a[0] + a[1] != b[0] for a, b in zip(spans, spans[1:])):
                raise OSError(f"{file.name}: the processes' parts do not tile the file")
            if len({path for _, _, path, _ in spans}) == len(spans):
                commit.storage.merge(commit.temporary(file.name), [p for _, _, p, _ in spans],
                                     [n for _, n, _, _ in spans])
            else:  # packed parts: read each object front to back, in file order
                commit.storage.write(commit.temporary(file.name),
                                     _read_spans(commit.storage, spans))


def _read_spans(storage: Storage, spans: list[tuple[int, int, str, int]]) -> Iterator[bytes]:
    """The bytes of ``spans`` in order, each object read sequentially through one reader."""
    readers: dict = {}
    try:
        for _, length, path, position in spans:
            reader = readers.get(path) or readers.setdefault(path, storage.open_read(path))
            reader.seek(position)
            yield reader.read(length)
    finally:
        for reader in readers.values():
            reader.close()


class Streamed(Strategy):
    """This process's ``files`` written whole, front to back, from ``chunks``; ``to_commit``
    (after every process has written) says what the commit puts in place.

    ``marks_files``: the index name of a layout whose files read as another kind of
    checkpoint without it (the distributed layout's read as torch DCP output), so that a
    backend writing final names marks the save as in progress first.
    """

    def __init__(self, files: Sequence[FilePlan], chunks: Chunks,
                 to_commit: Callable[[Operation], tuple[list[str], tuple[str, bytes] | None]],
                 *, marks_files: str | None = None):
        self.files, self.chunks, self.to_commit = list(files), chunks, to_commit
        self.marks_files = marks_files

    def write(self, op: Operation, commit: Commit) -> Written:
        _begin(op, commit, marks_files=self.marks_files)
        written = [0]

        def counted(file: FilePlan) -> Iterator[memoryview | bytes]:
            for chunk in self.chunks(file):
                op.check_cancelled()
                written[0] += len(chunk)
                yield chunk

        def write_all() -> None:
            for file in self.files:
                commit.storage.write(commit.temporary(file.name), counted(file))

        op.run("written", write_all, lambda: commit.discard(f.name for f in self.files))
        names, index = self.to_commit(op)
        header_bytes = sum(len(f.header) for f in self.files)
        return Written(names, index, written[0] - header_bytes, len(self.files), len(self.files))


def commit_written(op: Operation, commit: Commit, written: Written) -> None:
    """Process 0 puts the written files and the index in place; on a failure it has rolled
    back, and the files are discarded. Every process learns the outcome."""
    def put_in_place() -> None:
        try:
            commit.commit(written.files, written.index, op.at_commit_point)
        except BaseException:
            commit.discard(list(written.files) + ([written.index[0]] if written.index else []))
            raise
    op.on_primary("committed", put_in_place)
