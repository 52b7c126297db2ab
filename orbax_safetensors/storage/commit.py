"""Making a checkpoint visible, and keeping the old one whole until then.

The one place that knows the order of uncommit and commit, the lock against a
second writer, rollback and cleanup; the names these steps put on disk, and
what a reader makes of them, are ``naming``'s. Which of the old files mark a
checkpoint committed (its index) is the catalog's answer, handed in
(``Commit.markers``). Two strategies, chosen once from what the backend
declares (``Capabilities.cheap_rename``):

* ``StagedCommit`` -- renames are metadata (local disks, NFS, ``memory://``).
  Every file is written under a temporary name. The commit writes a journal
  naming the old checkpoint's files and the new ones, moves the old index and
  every old file a new one replaces to a backup name, renames the new files in
  (the index last) and removes the journal: that removal is the commit point.
  Until it, the old checkpoint is the committed one -- a reader that finds a
  journal reads the old files from their backups (``naming.read_view``) -- so a
  crash, an error or Ctrl-C at any step leaves the old checkpoint loadable; an
  error or Ctrl-C also rolls back (backups renamed back, temporaries removed),
  and the next writer rolls back what a crashed one left. One file replacing
  itself (``x.safetensors``, or ``model.safetensors`` over ``model.safetensors``)
  is a single atomic rename and needs no journal. Readers that do not know the
  journal (transformers) see the old index, then no index, then the new one:
  never old and new files mixed under one index.
* ``DirectCommit`` -- a rename is a copy of the bytes (object stores). Files
  are written under their final names: a marker naming every file the save
  writes is put down first, then the old index is removed before the first
  file changes, and the new index, written last, is the commit marker. A
  crash or failure in between leaves no checkpoint (the marker makes it read
  as an interrupted save), never a mix; the marker is also how the next save
  knows which files were ours to remove.

Only the writer holding the lock (``lock_name``) removes temporaries, so it
never removes a live writer's; a dead writer's lock is free again (the kernel
drops it with its process) and its debris is removed by the next writer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Collection, Iterable, Sequence

from orbax_safetensors.storage.base import Storage
from orbax_safetensors.storage.location import Location
from orbax_safetensors.storage.naming import (
    Journal,
    backup_name,
    is_staged_by_writer,
    is_transient,
    is_written_by,
    journal_name,
    journals,
    lock_name,
    marker_bytes,
    original_name,
    part_name,
    read_journal,
    temporary_name,
    writing_marker_name,
)

_LOG = logging.getLogger("orbax_safetensors")


def holder_description() -> str:
    """Who takes a lock: enough for a user to find the process that holds their path."""
    return f"pid {os.getpid()} on {socket.gethostname()}, thread {threading.current_thread().name}"


class _MadeDirectories:
    """The directories a writer made for its location because none was there (a first
    save), removed again when the writer leaves them empty: a save, consolidate or convert
    that fails must not leave behind an empty directory that reads as a checkpoint
    location. A directory that was there before is never removed, nor one holding anything."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.made: list[str] = []

    def make(self, path: str) -> None:
        self.made = self.storage.make_directories(path)

    def remove_empty(self) -> None:
        """After the writer's lock and temporaries are gone: on success the location holds
        the checkpoint, so nothing is removed."""
        made, self.made = self.made, []
        for path in made:  # deepest first
            if not self.storage.remove_empty_directory(path):
                return


class _WriterLock:
    """The lock of one location (a file beside what it guards), while this writer holds it."""

    def __init__(self, storage: Storage, path: str):
        self.storage, self.path = storage, path
        self._release: Callable[[], None] | None = None

    def take(self, then: Callable[[], None]) -> None:
        """Takes the lock (fails fast naming the holder), then runs ``then`` -- the clean-up of
        what dead writers left, which only the holder may do -- releasing the lock if it fails."""
        self._release = self.storage.lock(self.path, holder_description())
        try:
            then()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class _Claim:
    """A writer's hold on a location: the lock beside it, and the directories made for it."""

    def __init__(self, storage: Storage, directory: str, lock_path: str):
        self.directory = directory
        self._lock = _WriterLock(storage, lock_path)
        self._made = _MadeDirectories(storage)

    def take(self, recover: Callable[[], None]) -> None:
        """Makes the directory if it is missing, takes the lock (fails fast naming the holder)
        and runs ``recover`` under it; lets all of it go if any of that fails."""
        self._made.make(self.directory)
        try:
            self._lock.take(recover)
        except BaseException:
            self._made.remove_empty()
            raise

    def release(self) -> None:
        """Releases the lock; a directory made here and left empty (the write failed) goes too."""
        self._lock.release()
        self._made.remove_empty()


class Commit:
    """One save's commit protocol over one location (a directory, or one file in a directory).

    ``old`` are the names of what is there now (the committed checkpoint and
    checkpoint files left beside it), replaced by the commit; ``markers`` those
    of them that mark the old checkpoint committed (its indexes, as the catalog
    found them), taken away before any other file changes. A single-file
    location shares its directory with other files: only that file's own
    temporaries and lock are ever touched.
    """

    def __init__(self, location: Location, token: str, old: Collection[str],
                 markers: Collection[str] = (), claim: _Claim | None = None):
        self.location = location
        self.storage = location.storage
        self.directory = location.directory
        self.single_file = location.file_name
        self.token = token
        self.old = frozenset(old)
        self.markers = frozenset(markers)
        self._claim = claim  # held by the writer that took the location (``take``)

    @staticmethod
    def for_location(location: Location, token: str, old: Collection[str],
                     markers: Collection[str] = ()) -> Commit:
        """The commit of a save another process took the location for (or one whose caller
        owns a fresh location), replacing ``old`` after moving the ``markers`` away."""
        return _strategy(location)(location, token, old, markers)

    @staticmethod
    def take(location: Location, token: str,
             survey: Callable[[], tuple[Collection[str], Collection[str]]]) -> Commit:
        """The commit of the writer that takes ``location``: it locks it (failing fast, naming
        the holder), rolls back commits a dead writer left half done, asks ``survey`` which
        files the commit replaces and which of them mark the checkpoint committed (the
        catalog's answer; what ``survey`` raises, a refusal, lets the location go) and removes
        what dead writers left: from here on every temporary there is ours to remove.
        ``release`` lets the location go."""
        strategy = _strategy(location)
        storage, directory = location.storage, location.directory
        claim = _Claim(storage, directory, storage.join(directory, lock_name(location.file_name)))
        claim.take(lambda: strategy._recover(location))
        try:
            old, markers = survey()
            commit = strategy(location, token, old, markers, claim)
            commit._clear_leftovers()
        except BaseException:
            claim.release()
            raise
        return commit

    def path(self, name: str) -> str:
        return self.storage.join(self.directory, name)

    def temporary(self, name: str) -> str:
        """Where this save writes the file ``name`` before its commit."""
        raise NotImplementedError

    def part(self, name: str, offset: int) -> str:
        """Where a part of ``name`` starting at ``offset`` is uploaded before being merged."""
        return self.path(part_name(name, self.token, offset))

    def release(self) -> None:
        """Lets the location go, if this writer took it (``take``)."""
        if self._claim is not None:
            self._claim.release()

    @classmethod
    def _recover(cls, location: Location) -> None:
        """Rolls back commits a dead writer left half done."""

    def _clear_leftovers(self) -> None:
        """Removes what dead writers left (once ``survey`` has looked at what is there)."""

    def begin(self, files: Sequence[str]) -> None:
        """Before any process writes: what must happen before files change. ``files``: the
        name of every file the save writes, on every process (the index excluded)."""

    def commit(self, new: Sequence[str], whole: Sequence[tuple[str, bytes]] = (),
               at_commit_point: Callable[[], None] = lambda: None) -> None:
        """Puts ``new`` (written to ``temporary``) and ``whole`` in place, replacing ``old``.

        ``whole``: small files this writer writes here, at the commit, as (name,
        bytes): a model's ``config.json``, then the index, last of all since it is
        what marks the checkpoint committed.

        ``at_commit_point`` is called right before the step that makes the new
        checkpoint the committed one; what it raises (``KeyboardInterrupt`` for
        a cancelled save) stops the commit with nothing committed.
        """
        raise NotImplementedError

    def discard(self, names: Iterable[str]) -> None:
        """After a failure: removes this save's files of ``names`` (best effort)."""
        self.storage.discard(self.temporary(n) for n in names)

    def abandon(self) -> None:
        """After a failure before the commit point, on the process that took the location:
        removes the files this save wrote, by its token (temporaries, parts, the marker),
        which covers every process's, including any whose owner failed before saying what
        it wrote. Never a backup or a journal: a commit that failed half way is rolled back
        by its own steps (or by the next writer), never by a sweep. Best effort: the next
        writer removes what remains."""
        self.storage.discard(self._own(self.storage.listdir(self.directory)))

    def _own(self, listing: Iterable[str]) -> list[str]:
        """This save's temporaries, parts and marker among ``listing``."""
        return [self.path(n) for n in listing if is_written_by(n, self.token)]

    def _leftovers(self, listing: Iterable[str]) -> list[str]:
        return [self.path(n) for n in listing if is_transient(n, self.single_file)]


class StagedCommit(Commit):
    """Temporaries, a journal, backups and rollback, for backends whose renames are metadata
    (the module docstring tells the order and why)."""

    def temporary(self, name: str) -> str:
        return self.path(temporary_name(name, self.token))

    @classmethod
    def _recover(cls, location: Location) -> None:
        """Each journal left is a dead writer's commit: rolled back as a commit of its token."""
        if location.file_name is None:
            storage, directory = location.storage, location.directory
            for name in journals(storage.listdir(directory)):
                journal = read_journal(storage, storage.join(directory, name))
                cls(location, journal.token, journal.old)._roll_back(journal)

    def _clear_leftovers(self) -> None:
        for path in self._leftovers(self.storage.listdir(self.directory)):
            self.storage.remove(path)

    def commit(self, new: Sequence[str], whole: Sequence[tuple[str, bytes]] = (),
               at_commit_point: Callable[[], None] = lambda: None) -> None:
        storage = self.storage
        names = list(new)
        for name, data in whole:
            storage.write(self.temporary(name), [data])
            names.append(name)
        if len(names) == 1 and self.old <= {names[0]}:  # one file replacing itself: atomic
            at_commit_point()
            storage.rename(self.temporary(names[0]), self.path(names[0]), durable=False)
            self._make_durable()
            return
        replaced = tuple(n for n in names if storage.exists(self.path(n)))
        journal = Journal(self.token, tuple(sorted(self.old)), tuple(names), replaced)
        journal_path = self.path(journal_name(self.token))
        journal_temporary = self.temporary(journal_name(self.token))
        try:
            storage.write(journal_temporary, [journal.to_bytes()])
            storage.rename(journal_temporary, journal_path)
        except BaseException:
            storage.discard([journal_temporary, journal_path])
            raise
        try:
            # The old commit markers first: no reader that ignores the journal may find an
            # old index next to new files.
            # The renames need not each be durable: until the journal is gone, a power cut
            # anywhere among them still leaves the old checkpoint readable through it.
            old_indexes = sorted(self.markers)
            for name in old_indexes:
                storage.rename(self.path(name), self.path(backup_name(name, self.token)),
                               durable=False)
            for name in names:  # the index last
                if name in replaced and name not in old_indexes:
                    storage.rename(self.path(name), self.path(backup_name(name, self.token)),
                                   durable=False)
                storage.rename(self.temporary(name), self.path(name), durable=False)
            storage.sync_directory(self.directory)
            at_commit_point()
            storage.remove(journal_path)  # the commit point
        except BaseException as failure:
            try:
                self._roll_back(journal)
            except Exception as e:  # the old checkpoint still loads through the journal
                _LOG.warning("could not roll back the commit of %s (the previous checkpoint still "
                             "loads; the next save finishes the rollback): %s", self.directory, e)
                failure.add_note(f"rolling back failed too: {e}")
            raise
        self._make_durable()
        self._clean_up(set(names))

    def _make_durable(self) -> None:
        """After the commit point the save is committed, whatever happens next: a failure to
        flush the directory is reported, not raised (the caller would take it for a failed
        save and trust the old checkpoint, which is gone)."""
        try:
            self.storage.sync_directory(self.directory)
        except OSError as e:
            _LOG.warning("committed %s, but flushing the directory failed (a power cut now may "
                         "lose the commit): %s", self.directory, e)

    def _roll_back(self, journal: Journal) -> None:
        """Puts the old checkpoint's files back and removes the new ones, then the journal."""
        storage = self.storage
        for name in reversed(journal.new):
            backup = self.path(backup_name(name, journal.token))
            if storage.exists(backup):
                storage.rename(backup, self.path(name))
            elif name not in journal.replaced:  # nothing was there: what is there now is ours
                storage.remove(self.path(name))
            storage.remove(self.path(temporary_name(name, journal.token)))
        for name in journal.old:
            backup = self.path(backup_name(name, journal.token))
            if storage.exists(backup):
                storage.rename(backup, self.path(name))
        storage.remove(self.path(journal_name(journal.token)))

    def _clean_up(self, kept: set[str]) -> None:
        """After the commit point: the backups, then the old files the new checkpoint does not
        reuse. A failure here is no failure of the save (it is committed): the next one retries."""
        stale = [self.path(backup_name(n, self.token)) for n in kept | self.old]
        stale += [self.path(n) for n in self.old - kept]
        for path in stale:
            try:
                self.storage.remove(path)
            except OSError as e:
                _LOG.warning("committed, but could not remove %s (the next save will): %s", path, e)


class DirectCommit(Commit):
    """Final names and the index last, for object stores, where a rename copies every byte."""

    _writing: tuple[str, ...] = ()  # what ``begin`` marked (on the process that took the location)

    def temporary(self, name: str) -> str:
        return self.path(name)

    def begin(self, files: Sequence[str]) -> None:
        # One object replacing itself (or appearing) is atomic; anything else has a window.
        self._writing = tuple(files)
        if self.single_file is None and not (len(files) == 1 and self.old <= set(files)):
            self.storage.write(self.path(writing_marker_name(self.token)), [marker_bytes(files)])
        for name in sorted(self.markers):
            self.storage.remove(self.path(name))

    def commit(self, new: Sequence[str], whole: Sequence[tuple[str, bytes]] = (),
               at_commit_point: Callable[[], None] = lambda: None) -> None:
        at_commit_point()
        for name, data in whole:
            self.storage.write(self.path(name), [data])
        kept = set(new) | {name for name, _ in whole}
        stale = [self.path(n) for n in self.old - kept]
        for path in stale + self._leftovers(self.storage.listdir(self.directory)):
            self.storage.remove(path)

    def discard(self, names: Iterable[str]) -> None:
        """Files here are already under their final names, where the old index no longer
        names anything: remove ours, then the marker, so nothing half-written remains."""
        self._remove_written([self.path(n) for n in names])

    def abandon(self) -> None:
        self._remove_written([self.path(n) for n in self._writing])

    def _remove_written(self, paths: list[str]) -> None:
        """Our final-name files, then our other transients; the marker last, and only once no
        file it lists is left: without it, a leftover new file beside old ones (no index)
        would read as a checkpoint of its own."""
        listing = self.storage.listdir(self.directory)
        marker = self.path(writing_marker_name(self.token))
        self.storage.discard(paths + [p for p in self._own(listing) if p != marker])
        if self._writing and not any(self.storage.exists(self.path(n)) for n in self._writing):
            self.storage.discard([marker])  # put down here: ours to take away


class DirectorySwap:
    """Replaces a whole directory that another library writes (``convert``'s Orbax output),
    where no file-level commit applies.

    The new directory is written beside the old one under a temporary name;
    then the old one moves to a backup name, the new one is renamed in, and the
    backup is removed. A failure while writing removes the new directory and
    leaves the old one. The lock is the entry's own (``.NAME.lock`` beside it),
    held from before the write until after the swap, and whoever takes it next
    puts back an old directory a dead writer left under its backup name (a
    crash between the two renames) and removes what else dead writers left.
    """

    def __init__(self, location: Location, token: str):
        self.storage, self.token = location.storage, token
        self.target = location.path
        self.parent, self.name = self.storage.split(location.path)
        self.staged = self.storage.join(self.parent, temporary_name(self.name, token))
        self.backup = self.storage.join(self.parent, backup_name(self.name, token))
        self._claim = _Claim(self.storage, self.parent, self.storage.join(self.parent, lock_name(self.name)))

    def acquire(self) -> None:
        self._claim.take(self._recover)

    def release(self) -> None:
        self._claim.release()

    def _recover(self) -> None:
        for entry in sorted(self.storage.listdir(self.parent)):
            path = self.storage.join(self.parent, entry)
            if is_staged_by_writer(entry, self.name):
                self.storage.remove_tree(path)  # a dead writer's, under the library's name
            elif not is_transient(entry, self.name):
                continue
            elif original_name(entry) == self.name and not self.storage.exists(self.target):
                self.storage.rename_tree(path, self.target)  # a dead writer's old directory
            else:
                self.storage.remove_tree(path)

    def replace(self, write: Callable[[str], None]) -> None:
        """``write(url)`` creates the new directory at ``url``; then it is swapped in."""
        try:
            write(self.storage.url(self.staged))
        except BaseException as failure:
            self._discard_staged(failure)
            raise
        replacing = self.storage.exists(self.target)
        if replacing:
            self.storage.rename_tree(self.target, self.backup)
        try:
            self.storage.rename_tree(self.staged, self.target)
        except BaseException:
            if replacing:
                self.storage.rename_tree(self.backup, self.target)
            raise
        if replacing:
            try:
                self.storage.remove_tree(self.backup)
            except OSError as e:
                _LOG.warning("replaced %s, but could not remove %s (the next conversion "
                             "will): %s", self.target, self.backup, e)

    def _discard_staged(self, failure: BaseException) -> None:
        """After a failed write: removes the new directory, and what the writing library
        staged it under (best effort: the next writer removes what is left)."""
        staged = self.storage.split(self.staged)[1]
        try:
            for entry in self.storage.listdir(self.parent):
                if entry == staged or is_staged_by_writer(entry, self.name, self.token):
                    self.storage.remove_tree(self.storage.join(self.parent, entry))
        except Exception as e:  # must not mask the failure being reported
            _LOG.warning("could not remove %s after a failed write (the next conversion "
                         "will): %s", self.staged, e)
            failure.add_note(f"removing {self.staged} failed too: {e}")


def _strategy(location: Location) -> type[Commit]:
    """The strategy the backend's capabilities call for, chosen here and nowhere else."""
    return StagedCommit if location.storage.capabilities.cheap_rename else DirectCommit
