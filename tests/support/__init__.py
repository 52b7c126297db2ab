"""What the tests share: reference models, tolerances, child processes, servers and fault injectors.

Test files import from here only; nothing here imports a test file.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root: where ``bench/``, ``docs/``, ``examples/`` and ``scripts/`` are."""
