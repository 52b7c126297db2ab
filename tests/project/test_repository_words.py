"""The repository speaks of the code and its measurements, not of how the work on it was organised.

Every text file git tracks (or would track: untracked files not ignored) is searched for a small
set of phrases that belong to a work tracker rather than to the code: a tracker's item number,
"the issue's note", a note that closed an item, who built what on which machine. A hit fails with
``file:line: text`` for each. The fuzz corpus (binary inputs) is left out; so is this file, whose
patterns are also built from pieces so that it would not match itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from tests.support import REPO
SKIPPED_DIRS = ("tests/format/fuzz_corpus/",)
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()

_ISSUE = "iss" + "ue"
WORDS = [re.compile(pattern, re.IGNORECASE) for pattern in (
    rf"\b{_ISSUE}s? ?#?\d+\b",                    # a tracker's item number
    rf"\bthe {_ISSUE}(?:'s)?\b",                  # "the ... measured", "see the ...'s note"
    r"\bclos" + r"ing note\b",
    r"\bsess" + r"ion that (?:built|wrote)\b",
    r"\bwas le" + r"nt\b",                        # a machine lent to whoever measured
)]


def _git_files() -> list[str]:
    listed = []
    for extra in ([], ["--others", "--exclude-standard"]):
        try:
            result = subprocess.run(["git", "ls-files", "-z", *extra], cwd=REPO,
                                    capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return []
        if result.returncode != 0:
            return []
        listed += [name for name in result.stdout.decode("utf-8", "surrogateescape").split("\0") if name]
    return sorted(set(listed))


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_file_speaks_of_how_the_work_was_organised():
    files = _git_files()
    if not files:
        pytest.skip("not a git checkout (an installed copy or a build sandbox)")
    hits = []
    for name in files:
        if name == THIS_FILE or name.startswith(SKIPPED_DIRS):
            continue
        path = REPO / name
        if path.is_symlink() or not path.is_file():
            continue  # deleted in the work tree, a submodule or a link
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if any(word.search(line) for word in WORDS):
                hits.append(f"{name}:{number}: {line.strip()[:160]}")
    assert not hits, "words about the work rather than the code:\n" + "\n".join(hits)


def test_the_patterns_catch_what_they_are_for():
    caught = ["see " + "the " + _ISSUE + "'s note", _ISSUE + " #12", _ISSUE.title() + " 7 asked",
              "the " + "clos" + "ing note", "the sess" + "ion that built it", "no GPU was le" + "nt"]
    spared = ["one issued from a background thread", "the caller issues collectives",
              "huggingface/safetensors#686", "arenas lent out batch by batch", "a session's chunks"]
    for text in caught:
        assert any(word.search(text) for word in WORDS), text
    for text in spared:
        assert not any(word.search(text) for word in WORDS), text
