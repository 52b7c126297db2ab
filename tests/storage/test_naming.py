"""The on-disk naming protocol (``storage/naming.py``): what each name a save puts down counts
as, for the writer that removes it and for the reader that ignores it."""

from __future__ import annotations

import pytest

from orbax_safetensors.storage import naming

TOKEN, OTHER = "0123456789ab", "ba9876543210"
FILE = "model-00001-of-00002.safetensors"


def _every_name(token: str) -> dict[str, str]:
    return {"temporary": naming.temporary_name(FILE, token),
            "part": naming.part_name(FILE, token, 1 << 30),
            "backup": naming.backup_name(FILE, token),
            "journal": naming.journal_name(token),
            "marker": naming.writing_marker_name(token)}


def test_every_name_of_ours_is_hidden_and_transient_but_the_lock():
    for kind, name in _every_name(TOKEN).items():
        assert naming.is_hidden(name) and naming.is_transient(name), kind
    for lock in (naming.lock_name(None), naming.lock_name(FILE)):
        assert naming.is_hidden(lock) and not naming.is_transient(lock)
    assert not naming.is_transient(FILE) and not naming.is_hidden(FILE)
    # An earlier save's marker (an empty temporary of the distributed index) is one too.
    legacy = naming.temporary_name("orbax_safetensors.distributed.json", TOKEN)
    assert naming.is_transient(legacy) and naming.writing_markers([legacy, FILE]) == [legacy]


def test_a_single_file_owns_only_its_own_transients():
    """A single-file checkpoint shares its directory with the user's files."""
    assert naming.is_transient(naming.temporary_name("a.safetensors", TOKEN), "a.safetensors")
    assert not naming.is_transient(naming.temporary_name("b.safetensors", TOKEN), "a.safetensors")
    assert not naming.is_transient(naming.journal_name(TOKEN), "a.safetensors")


@pytest.mark.parametrize("kind, own", [("temporary", True), ("part", True), ("marker", True),
                                       ("backup", False), ("journal", False)])
def test_a_failed_save_removes_its_own_names_but_never_a_backup_or_a_journal(kind, own):
    assert naming.is_written_by(_every_name(TOKEN)[kind], TOKEN) is own
    assert not naming.is_written_by(_every_name(OTHER)[kind], TOKEN)


def test_a_backup_stands_for_its_original_and_a_journal_is_found_among_names():
    assert naming.original_name(naming.backup_name(FILE, TOKEN)) == FILE
    assert naming.original_name(naming.temporary_name(FILE, TOKEN)) != FILE
    assert naming.journals([FILE, naming.journal_name(OTHER), naming.journal_name(TOKEN)]) == [
        naming.journal_name(TOKEN), naming.journal_name(OTHER)]


def test_what_a_directory_writer_stages_under_our_temporary_name():
    staged = naming.temporary_name("orbax", TOKEN) + ".orbax-checkpoint-tmp-1700000000"
    assert naming.is_staged_by_writer(staged, "orbax")
    assert naming.is_staged_by_writer(staged, "orbax", TOKEN)
    assert not naming.is_staged_by_writer(staged, "orbax", OTHER)
    assert not naming.is_staged_by_writer(staged, "other")
    assert not naming.is_staged_by_writer(naming.temporary_name("orbax", TOKEN), "orbax")
