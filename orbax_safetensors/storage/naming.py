"""The on-disk naming protocol: the names a save puts beside a checkpoint, and what a reader
makes of them.

Every name of ours but a checkpoint's own files is hidden (starts with
``.``), and a reader ignores every hidden name, except through a journal
(below). The names, who writes each and who removes it:

* ``.NAME.tmp-TOKEN`` -- the file ``NAME`` before its commit (``StagedCommit``;
  also the directory ``DirectorySwap`` stages, and ``.NAME.tmp-TOKEN.*``, what
  the library writing that directory stages it under: ``is_staged_by_writer``). Renamed in by the
  commit; removed by its writer after a failure.
* ``.NAME.part-TOKEN-OFFSET`` -- a part of ``NAME`` uploaded on its own and
  merged into it (object stores, several processes). Removed by the writer
  once merged or after a failure.
* ``.NAME.old-TOKEN`` -- the file ``NAME`` of the checkpoint a commit in
  progress replaces (its backup). Removed after the commit point; renamed back
  by a rollback.
* ``.orbax_safetensors.commit-TOKEN.json`` -- the journal of a ``StagedCommit``
  (``Journal``): the old checkpoint's files and the new ones. While it is
  there, the old checkpoint is the committed one and a reader reads it through
  the journal (``read_view``); its removal is the commit point. The next
  writer rolls back a journal a dead one left.
* ``.orbax_safetensors.writing-TOKEN.json`` -- the marker a ``DirectCommit``
  puts down before its files go to their final names, listing them: without
  an index, such files are an interrupted save (never a checkpoint), and the
  next save may remove exactly them. Earlier saves marked only distributed
  saves, with an empty ``.orbax_safetensors.distributed.json.tmp-TOKEN``.
* ``.orbax_safetensors.lock`` (a directory), ``.NAME.lock`` (one file, or a
  directory ``DirectorySwap`` replaces) -- the writer's lock, taken and
  released by the writer. Only its holder removes the names above
  ("transient": ``is_transient``), so a live writer's are never removed; a dead
  writer's are removed by the next one. A writer removes its own
  (``is_written_by``) when it fails, never a backup or a journal: a commit that
  failed half way is rolled back by its own steps or by the next writer.

What a reader ignores: every hidden name (``is_hidden``). ``verify`` lists the
transient ones as leftovers, and files a marker lists, without an index, as
an interrupted save.

``TOKEN`` is 12 hex digits, one per save, so a writer knows its own names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable

from orbax_safetensors.errors import StorageError
from orbax_safetensors.storage.base import Storage
from orbax_safetensors.storage.retry import SNAPSHOT_REREADS

_LOCK = ".orbax_safetensors.lock"
_JOURNAL = re.compile(r"^\.orbax_safetensors\.commit-([0-9a-f]{12})\.json$")
_WRITING = re.compile(r"^\.orbax_safetensors\.writing-([0-9a-f]{12})\.json$")
_LEGACY_WRITING = re.compile(r"^\.orbax_safetensors\.distributed\.json\.tmp-[0-9a-f]{12}$")
_TRANSIENT = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|part|old)-(?P<token>[0-9a-f]{12})(?:-\d{20})?$")
_MAX_JOURNAL_BYTES = 64 << 20


def temporary_name(name: str, token: str) -> str:
    return f".{name}.tmp-{token}"


def part_name(name: str, token: str, offset: int) -> str:
    return f".{name}.part-{token}-{offset:020d}"


def backup_name(name: str, token: str) -> str:
    return f".{name}.old-{token}"


def journal_name(token: str) -> str:
    return f".orbax_safetensors.commit-{token}.json"


def writing_marker_name(token: str) -> str:
    return f".orbax_safetensors.writing-{token}.json"


def lock_name(single_file: str | None) -> str:
    """The lock of a directory (``None``), or of the one entry ``single_file`` in it."""
    return _LOCK if single_file is None else f".{single_file}.lock"


def is_hidden(name: str) -> bool:
    """A name no reader takes for a checkpoint file: every name of ours but the files."""
    return name.startswith(".")


def is_transient(name: str, single_file: str | None = None) -> bool:
    """Whether ``name`` is a temporary, part, backup, journal or marker of ours (of the entry
    ``single_file`` only, when a directory is shared with other files): never part of a
    checkpoint, removed by the writer that holds the lock. The lock itself is not one."""
    match = _TRANSIENT.match(name)
    if single_file is not None:
        return bool(match and match["name"] == single_file)
    return bool(match or _JOURNAL.match(name) or _WRITING.match(name))  # a legacy marker is a .tmp-


def is_written_by(name: str, token: str) -> bool:
    """Whether ``name`` is a temporary, part or marker of the save ``token``: what it removes
    when it fails. Never a backup: a commit that failed half way puts those back."""
    match = _TRANSIENT.match(name)
    return bool(match and match["token"] == token and match["kind"] != "old"
                or name == writing_marker_name(token))


def is_staged_by_writer(name: str, target: str, token: str | None = None) -> bool:
    """Whether ``name`` is what the library writing a directory for the entry ``target``
    makes of the temporary name of save ``token`` (of any save, without one): Orbax writes
    ``STAGED.orbax-checkpoint-tmp`` (with a timestamp in some versions) and renames it to
    ``STAGED`` once complete."""
    staged = re.escape(temporary_name(target, "")) + (re.escape(token) if token else "[0-9a-f]{12}")
    return bool(re.fullmatch(staged + r"\..+", name))


def original_name(name: str) -> str:
    """The checkpoint file a name stands for: ``X`` for ``X`` and for its backup ``.X.old-T``."""
    match = _TRANSIENT.match(name)
    return match["name"] if match and match["kind"] == "old" else name


def writing_markers(names: Iterable[str]) -> list[str]:
    """The markers among a directory's ``names`` that a ``DirectCommit`` puts down while its
    files go to their final names: a save in progress, or one that died (without their index
    those files would read as a checkpoint of their own: some tensors, or old and new mixed)."""
    return sorted(n for n in names if _WRITING.match(n) or _LEGACY_WRITING.match(n))


def marker_bytes(files: Iterable[str]) -> bytes:
    """A writing marker's content: the names of the files its save writes."""
    return json.dumps({"files": sorted(files)}).encode()


def files_of_marker(storage: Storage, path: str) -> frozenset[str]:
    """The files the save that put down the marker at ``path`` writes: its own, which the next
    save may remove. Empty for a marker that lists none (an earlier save's) or that is gone."""
    try:
        size = storage.size(path)
        raw = json.loads(storage.read(path, 0, min(size, _MAX_JOURNAL_BYTES))) if size else {}
    except (OSError, ValueError):
        return frozenset()
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and "/" not in f for f in files):
        return frozenset()
    return frozenset(files)


@dataclasses.dataclass(frozen=True)
class Journal:
    """A ``StagedCommit`` in progress, as its journal file records it."""

    token: str
    old: tuple[str, ...]  # the files of the checkpoint being replaced
    new: tuple[str, ...]  # the files being put in place, the index last
    replaced: tuple[str, ...]  # the new names that held a file before (moved to backups)

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()


def read_journal(storage: Storage, path: str) -> Journal:
    size = storage.size(path)
    if size > _MAX_JOURNAL_BYTES:
        raise StorageError(f"{path}: commit journal of {size} bytes is not ours",
                           url=storage.url(path))
    raw = json.loads(storage.read(path, 0, size))
    return Journal(raw["token"], tuple(raw["old"]), tuple(raw["new"]), tuple(raw["replaced"]))


def journals(names: Iterable[str]) -> list[str]:
    """The journals among a directory's ``names``, in name order (there is one at most, unless
    a writer died in its commit and the next one died in its rollback)."""
    return sorted(n for n in names if _JOURNAL.match(n))


@dataclasses.dataclass(frozen=True)
class DirectoryView:
    """What a reader takes for the checkpoint in a directory at one moment.

    ``names`` are the entries to consider (hidden ones excluded); ``moved``
    maps a name to the backup it is read from while a commit is in progress;
    ``listing`` is every entry the directory held, with its version. Two views
    compare equal only when a reader resolving names through either opens the
    same files: a commit that ran to completion in between leaves the same
    names but other versions.
    """

    names: frozenset[str]
    moved: tuple[tuple[str, str], ...] = ()
    listing: tuple[tuple[str, str], ...] = ()

    @property
    def entries(self) -> frozenset[str]:
        """Every name the directory held, hidden ones included."""
        return frozenset(name for name, _ in self.listing)

    def path(self, storage: Storage, directory: str, name: str) -> str:
        return storage.join(directory, dict(self.moved).get(name, name))

    def relocate(self, storage: Storage, path: str) -> str | None:
        """Where the file a reader opened at ``path`` (under another view of the same
        directory) is to be found under this one; None if this view has no such file."""
        directory, name = storage.split(path)
        name = original_name(name)
        return self.path(storage, directory, name) if name in self.names else None


def read_view(storage: Storage, directory: str) -> DirectoryView:
    """The committed checkpoint's names in ``directory`` (FileNotFoundError if it is absent).

    With a journal present, a commit is in progress or its writer died in it:
    the old checkpoint is the committed one, its files where the journal's
    writer left them (moved to backups, or not yet).
    """
    for _ in SNAPSHOT_REREADS.tries():
        versions = storage.list_versions(directory)
        listing = tuple(sorted(versions.items()))
        found = journals(versions)
        if not found:
            return DirectoryView(frozenset(n for n in versions if not is_hidden(n)), (), listing)
        try:
            journal = read_journal(storage, storage.join(directory, found[0]))
        except FileNotFoundError:
            continue  # the commit completed between the listing and the read: look again
        moved = tuple(sorted((n, backup_name(n, journal.token)) for n in journal.old
                             if backup_name(n, journal.token) in versions))
        return DirectoryView(frozenset(journal.old), moved, listing)
    raise StorageError(f"{directory}: commits kept completing while its listing was read",
                       url=storage.url(directory))
