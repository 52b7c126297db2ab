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

Checksums (``format.checksums``) are computed by each writer over the bytes it
writes, as it writes them: no file is read back. A checksummed file's header
is planned with zeros where its block CRCs go; once the data is written the
header is replaced by one of the same length holding them. In place, process
0 rewrites the header's bytes; in parts, process 0 uploads the objects that
hold headers last; streamed, the writer holds the header back (writing it
over the zeros, or as the first part of a merge, or with data held in memory
where the backend has neither).
"""

from __future__ import annotations

import abc
import base64
import collections
import errno
import dataclasses
import functools
import itertools
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from orbax_safetensors.engine.core.coordination import Peers
from orbax_safetensors.engine.saving.device_copies import HostCopies
from orbax_safetensors.storage.executor import Executor
from orbax_safetensors.engine.core.operation import Operation
from orbax_safetensors.errors import ProtocolError, StorageError
from orbax_safetensors.format.checksums import FileChecksums, Piece, Pieces, Tally
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
from orbax_safetensors.storage import Replayable, Storage
from orbax_safetensors.storage.commit import Commit

WRITE_CHUNK_BYTES = 64 << 20  # the largest single write request
WRITE_THREADS = 8
_MAX_OBJECTS_PER_FILE = 64  # beyond this a process packs its small ranges of a file into one object
_SMALL_OBJECT = 4 << 20  # an object smaller than this costs more in requests than it moves
_VIEWS_PER_WRITE = 1024  # buffers per pwritev (Linux's IOV_MAX)
_SUMMED_CHUNKS, _SUMMED_BYTES = 1024, 4 << 20  # a streamed file's chunks held back to be summed at once

Payloads = Sequence[memoryview]  # the bytes of each shard a process writes, by Segment.target
Chunks = Callable[[FilePlan], Iterable[memoryview | bytes]]  # a file's data, front to back
FileCrcs = dict[str, int]  # file name → crc32c of the whole file, for the index


class Checksums:
    """The crc32c pieces of the bytes this process writes (``add``, from any thread), per
    checksummed file of ``files``; completed into each file's block CRCs where all its bytes
    were written here (``local``) or on process 0 from every process's (``gathered``)."""

    def __init__(self, files: Sequence[FilePlan]):
        self.files = {f.name: f for f in files if f.checksummed}
        self._pieces: dict[str, list[Pieces]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def add(self, file: str, offset: int, views: Sequence[memoryview | bytes]) -> None:
        """The bytes ``views`` hold back to back from ``offset`` of ``file`` were written."""
        if file in self.files:
            pieces = self.files[file].grid.pieces(offset, views)
            with self._lock:
                self._pieces[file].append(pieces)

    def local(self, name: str) -> np.ndarray:
        """Block CRCs of file ``name``, which this process wrote whole."""
        return self._complete([self._encode()], [name])[name]

    def gathered(self, peers: Peers) -> dict[str, np.ndarray] | None:
        """On process 0, block CRCs of every file from every process's pieces (``None`` on the
        others). Blocks complete within a process cross as CRCs, the rest as pieces."""
        raw = peers.gather_to_primary("crc32c", self._encode())
        return None if raw is None else self._complete(raw)

    def _encode(self) -> str:
        document = {}
        with self._lock:
            by_file = {name: list(pieces) for name, pieces in self._pieces.items()}
        for name, pieces in by_file.items():
            tally = Tally(self.files[name].grid)
            done = tally.add(Pieces.concatenate(pieces))
            blocks, crcs = done[:, 0], done[:, 1].astype(np.uint32)
            document[name] = {"blocks": base64.b64encode(blocks.tobytes()).decode(),
                              "crcs": base64.b64encode(crcs.tobytes()).decode(),
                              "partial": [[p.block, p.start, p.length, p.crc] for p in tally.partial()]}
        return json.dumps(document)

    def _complete(self, raw: Sequence[str], names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        result = {}
        documents = [json.loads(r) for r in raw]
        for name in self.files if names is None else names:
            file = self.files[name]
            crcs, seen = np.zeros(file.grid.count, np.uint32), np.zeros(file.grid.count, bool)
            tally = Tally(file.grid)
            for document in documents:
                part = document.get(name)
                if part is None:
                    continue
                blocks = np.frombuffer(base64.b64decode(part["blocks"]), np.int64)
                crcs[blocks] = np.frombuffer(base64.b64decode(part["crcs"]), np.uint32)
                seen[blocks] = True
                for block, crc in tally.add(Piece(*p) for p in part["partial"]):
                    crcs[block], seen[block] = crc, True
            if not seen.all():
                missing = int(np.flatnonzero(~seen)[0])
                raise ProtocolError(f"{name}: no process wrote all of block {missing} "
                                     f"{file.grid.block(missing)}")
            result[name] = crcs
        return result


def final_headers(files: Sequence[FilePlan], crcs: dict[str, np.ndarray]) -> tuple[dict[str, bytes], FileCrcs]:
    """Each checksummed file's header holding its block CRCs, and every file's whole crc32c."""
    headers = {f.name: f.header_with(crcs[f.name]) for f in files if f.name in crcs}
    return headers, {f.name: FileChecksums(f.grid, crcs[f.name]).file_crc(headers[f.name])
                     for f in files if f.name in crcs}


@dataclasses.dataclass
class Written:
    """What this process wrote, and what the commit then puts in place."""

    files: list[str]  # every process's files, by name
    index: tuple[str, bytes] | None
    bytes_written: int = 0
    requests: int = 0
    files_written: int = 0
    file_crcs: FileCrcs = dataclasses.field(default_factory=dict)  # to check before the commit
    copied_peak: int = 0  # the most bytes copied off accelerators and not yet written, at once


class Strategy(abc.ABC):
    """Moves this process's planned bytes into a save's files (not yet committed)."""

    @abc.abstractmethod
    def write(self, op: Operation, commit: Commit) -> Written:
        """Writes and agrees with the other processes; raises (on every process) on failure."""


def for_storage(storage: Storage, plan: WritePlan,
                owned: Callable[[], Sequence[tuple[str, Transfers]]],
                copies: HostCopies, streamed: Chunks) -> Strategy:
    """The strategy an hf save takes on ``storage``, from its declared capabilities.

    ``owned`` plans this process's byte ranges (``planning.owned_ranges``),
    ``copies`` gives its shards' bytes, ``streamed`` a whole file's data (of the
    same shards). Writes in place take the shards' bytes in order, each once: copies
    off an accelerator follow a window ahead of them (``device_copies``); the others
    may take them again (a retried upload replays), so every copy starts at once.
    """
    capabilities = storage.capabilities
    if capabilities.offset_writes:
        return InPlace(plan, owned(), copies)
    copies.prefetch_all()
    if capabilities.server_side_merge or jax.process_count() > 1:
        return InParts(plan, owned(), copies)
    return Streamed(plan.files, streamed, lambda op, crcs: ([f.name for f in plan.files], plan.index(crcs)))


def _begin(op: Operation, commit: Commit, files: Sequence[str]) -> None:
    """Process 0 makes the directory and marks the location before any file changes;
    ``files``: every process's (``Commit.begin``)."""
    def begin() -> None:
        commit.storage.makedirs(commit.directory)
        commit.begin(files)
    op.on_primary("begun", begin)


def _views(segments: Iterable[Segment], payloads: Payloads, header: bytes = b"") -> list[memoryview]:
    """The bytes of ``segments``; one that is all of a payload is that payload (a slice of
    each costs more than writing a small tensor)."""
    return [memoryview(header) if target == HEADER
            else payloads[target] if offset == 0 and length == len(payloads[target])
            else payloads[target][offset:offset + length]
            for target, offset, length in segments]


def _shards_of(targets: Iterable[int]) -> Iterator[int]:
    """The payload indices among segment ``targets`` (the header is no shard's)."""
    return (t for t in targets if t != HEADER)


def _gather_checksums(op: Operation, checksums: Checksums,
                      clean_up: Callable[[], None]) -> tuple[dict[str, bytes], FileCrcs]:
    """Process 0: every file's final header and whole crc32c, from every process's pieces."""
    if not checksums.files:  # the same plan everywhere: every process skips it alike
        return {}, {}
    crcs = op.run("checksummed", lambda: checksums.gathered(op.peers), clean_up)
    return final_headers(list(checksums.files.values()), crcs or {}) if op.is_primary else ({}, {})


class InPlace(Strategy):
    """Shared files created at their final size; every process fills its own ranges."""

    def __init__(self, plan: WritePlan, owned: Sequence[tuple[str, Transfers]], copies: HostCopies):
        self.plan, self.owned, self.copies = plan, owned, copies

    def write(self, op: Operation, commit: Commit) -> Written:
        storage = commit.storage
        names = [f.name for f in self.plan.files]

        def create() -> None:
            storage.makedirs(commit.directory)
            commit.begin(names)
            for file in self.plan.files:
                op.check_going()
                storage.create_sized(commit.temporary(file.name), file.size, file.header)

        op.on_primary("created", create, lambda: commit.discard(names))
        payloads = self.copies.uses(t for _, transfers in self.owned for r in transfers
                                    for t in _shards_of(r.targets.tolist()))
        checksums = Checksums(self.plan.files)

        def write_range(file_name: str, request: Transfer) -> None:
            try:
                write_views(file_name, request)
            finally:
                payloads.finished()

        def write_views(file_name: str, request: Transfer) -> None:
            # Views a batch at a time: a range of strided shards holds a run per row of each,
            # and a memoryview per run for a whole 64 MB range costs more than its bytes.
            offset, segments = request.offset, list(request.segments)
            for start in range(0, len(segments), _VIEWS_PER_WRITE):
                op.check_going()
                these = segments[start:start + _VIEWS_PER_WRITE]
                batch = _views(these, payloads)
                checksums.add(file_name, offset, batch)
                storage.write_at(commit.temporary(file_name), offset, batch)
                written = sum(len(view) for view in batch)
                offset += written
                op.wrote(written)
                payloads.done(_shards_of(t for t, _, _ in these))

        files = sorted({name for name, _ in self.owned})

        def write_all() -> None:
            with op.executor(WRITE_THREADS, "orbax_safetensors-write") as pool:
                writes = []
                for name, request in ((n, r) for n, transfers in self.owned for r in transfers):
                    if any(f.done() and f.exception() for f in writes):
                        break  # the wait below raises it
                    payloads.admit(_shards_of(request.targets.tolist()))
                    writes.append(pool.submit(write_range, name, request))
                pool.wait(writes)
                pool.wait([pool.submit(storage.sync, commit.temporary(name)) for name in files])

        discard = lambda: commit.discard(names) if op.is_primary else None  # noqa: E731
        op.run("written", write_all, discard)
        headers, file_crcs = _gather_checksums(op, checksums, discard)

        def rewrite_headers() -> None:
            with op.executor(WRITE_THREADS, "orbax_safetensors-headers") as pool:
                pool.wait([pool.submit(self._rewrite, storage, commit.temporary(name), header)
                           for name, header in headers.items()])

        op.on_primary("headers", rewrite_headers, discard)
        return Written(names, self.plan.index(file_crcs), payloads.nbytes,
                       sum(len(transfers) for _, transfers in self.owned), len(files), file_crcs, payloads.peak)

    @staticmethod
    def _rewrite(storage: Storage, path: str, header: bytes) -> None:
        storage.write_at(path, 0, [memoryview(header)])
        storage.sync(path)


class InParts(Strategy):
    """Part objects uploaded in parallel by their owners, merged server-side by process 0.

    The objects holding a checksummed file's header are uploaded last, by process
    0, once every process's checksums are in.
    """

    def __init__(self, plan: WritePlan, owned: Sequence[tuple[str, Transfers]], payloads: HostCopies):
        self.plan, self.payloads = plan, payloads
        headers = self.plan.files if jax.process_index() == 0 else ()
        self.uploads = plan_uploads(owned, headers, max_objects_per_file=_MAX_OBJECTS_PER_FILE,
                                    small_object=_SMALL_OBJECT)

    def write(self, op: Operation, commit: Commit) -> Written:
        storage = commit.storage
        names = [f.name for f in self.plan.files]
        headers = {f.name: f.header for f in self.plan.files}
        payloads = self.payloads
        checksums = Checksums(self.plan.files)
        _begin(op, commit, names)
        last, now = self._headers_last(checksums)

        def views(item: Upload) -> list[memoryview]:
            return [v for r in item.ranges for v in _views(r.segments, payloads, headers.get(item.file, b""))]

        def upload(item: Upload) -> None:
            op.check_going()
            data = views(item)
            storage.write(commit.part(item.file, item.key), data)
            op.wrote(sum(len(view) for view in data))

        def upload_all() -> None:
            for item in last:  # uploaded once the headers are final; summed now
                checksums.add(item.file, item.key, views(item))
            with op.executor(WRITE_THREADS, "orbax_safetensors-upload") as pool:
                pool.wait([pool.submit(self._counted, checksums, item, views, upload) for item in now])

        own_parts = sorted({commit.part(u.file, u.key) for u in self.uploads})
        op.run("uploaded", upload_all, lambda: storage.discard(own_parts))
        every = [tuple(p) for raw in op.exchange("parts", json.dumps(self._ranges()), lambda: storage.discard(own_parts))
                 for p in json.loads(raw)]
        part_objects = sorted({commit.part(file, key) for file, _, _, key, _ in every})
        final, file_crcs = _gather_checksums(
            op, checksums, lambda: (storage.discard(part_objects), commit.discard(names)) if op.is_primary else None)
        headers.update(final)

        def assemble() -> None:
            try:
                with op.executor(WRITE_THREADS, "orbax_safetensors-upload") as pool:
                    pool.wait([pool.submit(upload, item) for item in last])
                self._assemble(op, commit, every)
            except BaseException:
                storage.discard(part_objects)
                commit.discard(names)
                raise
            with op.executor(WRITE_THREADS, "orbax_safetensors-cleanup") as pool:
                pool.map(storage.remove, part_objects)

        op.on_primary("merged", assemble)
        return Written(names, self.plan.index(file_crcs), sum(len(p) for p in payloads),
                       len(self.uploads), len({u.file for u in self.uploads}), file_crcs)

    def _headers_last(self, checksums: Checksums) -> tuple[list[Upload], list[Upload]]:
        """The uploads holding a checksummed file's header (uploaded once it is final), and
        the others."""
        last = [u for u in self.uploads if u.file in checksums.files
                and any((r.targets == HEADER).any() for r in u.ranges)]
        return last, [u for u in self.uploads if not any(u is v for v in last)]

    def _ranges(self) -> list[list]:
        """(file, offset, length, object key, position in the object) of every range this
        process uploads, for process 0 to assemble the files from."""
        return [[u.file, r.offset, r.length, u.key, position]
                for u in self.uploads
                for r, position in zip(u.ranges, itertools.accumulate(
                    (r.length for r in u.ranges), initial=0))]

    @staticmethod
    def _counted(checksums: Checksums, item: Upload, views: Callable[[Upload], list[memoryview]],
                 upload: Callable[[Upload], None]) -> None:
        checksums.add(item.file, item.key, views(item))
        upload(item)

    def _assemble(self, op: Operation, commit: Commit, parts: list[tuple]) -> None:
        """Process 0: each file from its parts, server-side where each part is one object."""
        by_file = collections.defaultdict(list)
        for name, offset, length, key, position in parts:
            by_file[name].append((offset, length, commit.part(name, key), position))
        for file in self.plan.files:
            op.check_going()
            spans = sorted(by_file[file.name])
            covered = sum(n for _, n, _, _ in spans)
            if covered != file.size or any(a[0] + a[1] != b[0] for a, b in zip(spans, spans[1:])):
                raise ProtocolError(f"{file.name}: the processes' parts do not tile the file")
            if len({path for _, _, path, _ in spans}) == len(spans):
                commit.storage.merge(commit.temporary(file.name), [p for _, _, p, _ in spans],
                                     [n for _, n, _, _ in spans])
            else:  # packed parts: read each object front to back, in file order
                commit.storage.write(commit.temporary(file.name), Replayable(
                    functools.partial(_read_spans, commit.storage, spans)))


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
    """This process's ``files`` written whole, front to back, from ``chunks`` (each file's
    data); ``to_commit`` (after every process has written; given the whole crc32c of each
    file this process wrote) says what the commit puts in place.
    """

    def __init__(self, files: Sequence[FilePlan], chunks: Chunks,
                 to_commit: Callable[[Operation, FileCrcs], tuple[list[str], tuple[str, bytes] | None]]):
        self.files, self.chunks, self.to_commit = list(files), chunks, to_commit

    def write(self, op: Operation, commit: Commit) -> Written:
        every = op.exchange("files", json.dumps([f.name for f in self.files]))
        _begin(op, commit, sorted({name for raw in every for name in json.loads(raw)}))
        written = [0]
        checksums = Checksums(self.files)
        file_crcs: FileCrcs = {}

        def counted(file: FilePlan) -> Replayable:
            # Replayed whole when an upload is retried: the same bytes are summed again,
            # which completes the same blocks with the same CRCs. Chunks are summed a few
            # at a time (a chunk per tiny tensor summed alone costs more than its bytes),
            # all of them before the stream ends.
            def stream() -> Iterator[memoryview | bytes]:
                offset, pending, pending_bytes = file.data_start, [], 0
                for chunk in self.chunks(file):
                    op.check_going()
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    if len(pending) >= _SUMMED_CHUNKS or pending_bytes >= _SUMMED_BYTES:
                        checksums.add(file.name, offset, pending)
                        offset, pending, pending_bytes = offset + pending_bytes, [], 0
                    op.wrote(len(chunk))
                    yield chunk
                checksums.add(file.name, offset, pending)
            return Replayable(stream)

        def write_all() -> None:
            for file in self.files:
                path = commit.temporary(file.name)
                if not file.checksummed:
                    commit.storage.write(path, _after(file.header, counted(file)))
                else:
                    _write_header_last(commit, file, counted(file), functools.partial(header, file))
                    check_stored(commit.storage, {path: file_crcs[file.name]})
                written[0] += file.size - file.data_start

        def header(file: FilePlan) -> bytes:
            headers, whole = final_headers([file], {file.name: checksums.local(file.name)})
            file_crcs.update(whole)
            return headers[file.name]

        op.run("written", write_all, lambda: commit.discard(f.name for f in self.files))
        names, index = self.to_commit(op, file_crcs)
        return Written(names, index, written[0], len(self.files), len(self.files))


def _after(head: bytes | memoryview, data: Replayable) -> Replayable:
    return Replayable(lambda: itertools.chain([head], data))


def _write_header_last(commit: Commit, file: FilePlan, data: Replayable,
                       header: Callable[[], bytes]) -> None:
    """Writes ``file`` from its ``data``, its ``header`` asked for once the data has passed.

    Over the planned header where the backend writes at offsets; else as a
    merge of two objects, the header with the first data (as much as a merge's
    first part needs) held in memory, the rest streamed; else (``memory://``)
    with all the data held.
    """
    storage, path = commit.storage, commit.temporary(file.name)
    capabilities = storage.capabilities
    if capabilities.offset_writes:
        storage.write(path, _after(file.header, data))
        storage.write_at(path, 0, [memoryview(header())])
        storage.sync(path)
        return
    held, chunks = bytearray(), iter(data)
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        room = capabilities.first_part_bytes - len(held) if capabilities.server_side_merge else len(view)
        held += view[:room]
        if len(view) > room:
            rest = data.after(len(held), itertools.chain([view[room:]], chunks))
            break
    else:
        storage.write(path, [header(), held])
        return
    first, second = commit.part(file.name, 0), commit.part(file.name, file.data_start + len(held))
    try:
        storage.write(second, rest)
        head = header()
        storage.write(first, [head, held])
        storage.merge(path, [first, second], [len(head) + len(held), file.size - len(head) - len(held)])
    finally:
        storage.discard([first, second])


def check_stored(storage: Storage, paths: dict[str, int]) -> None:
    """Raises unless each object holds the bytes whose crc32c we computed as we wrote them
    (``paths``: path → crc), where the store keeps a crc32c of its own: an upload corrupted
    on the way fails the save before it is committed."""
    def check(path: str) -> None:
        stored = storage.stored_crc32c(path)
        if stored is not None and stored != paths[path]:
            raise StorageError(f"the store holds other bytes than were written (its crc32c "
                               f"{stored:#010x}, ours {paths[path]:#010x}); nothing was committed",
                               url=path, code=errno.EIO)

    with Executor(WRITE_THREADS, name="orbax_safetensors-check") as pool:
        pool.map(check, paths)


def commit_written(op: Operation, commit: Commit, written: Written,
                   beside: Sequence[tuple[str, bytes]] = ()) -> None:
    """Process 0 checks the files against the store's own checksums and puts them, the files
    ``beside`` them (a ``config.json``: name, bytes) and the index in place; on a failure it
    has rolled back, and the files are discarded. Every process learns the outcome."""
    def put_in_place() -> None:
        try:
            check_stored(commit.storage, {commit.temporary(name): crc
                                          for name, crc in written.file_crcs.items()})
            commit.commit(written.files, [*beside, *([written.index] if written.index else [])],
                          op.at_commit_point)
        except BaseException:
            commit.discard(list(written.files) + ([written.index[0]] if written.index else []))
            raise
    op.on_primary("committed", put_in_place)
