"""The range of orbax-checkpoint the Orbax integration is built and tested against.

The integration leans on Orbax behaviour that is not a stable API: how
``CompositeCheckpointHandler`` creates item directories in the background
(contracted signals), how a no-argument restore finds a handler through the
typestr in ``_CHECKPOINT_METADATA``, and the v1 handler registry with
secondary typestrs. Outside the tested range those may differ silently, so
the integration refuses to load there and says which versions work; the
engine (``ost.save``/``ost.load``) does not depend on Orbax at all.
"""

from __future__ import annotations

import importlib.metadata
import re

from orbax_safetensors.errors import UnsupportedOrbaxError

MINIMUM = (0, 12, 5)  # older ones lack the v1 API the layout implements (ocp.v1.save, load)
BELOW = (0, 13, 0)
SUPPORTED_RANGE = ">=0.12.5,<0.13"


def _release(version: str) -> tuple[int, ...]:
    """``"0.12.8"`` → ``(0, 12, 8)``; pre-release and local suffixes are ignored."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group().split(".")) if match else ()


def check_orbax_version(version: str | None = None) -> None:
    """Raises ``UnsupportedOrbaxError`` unless orbax-checkpoint ``version`` (default: installed) fits."""
    if version is None:
        try:
            version = importlib.metadata.version("orbax-checkpoint")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedOrbaxError(
                "the Orbax integration of orbax_safetensors needs orbax-checkpoint"
                f"{SUPPORTED_RANGE}, which is not installed: pip install "
                f"'orbax-checkpoint{SUPPORTED_RANGE}'") from None
    if not MINIMUM <= _release(version) < BELOW:
        raise UnsupportedOrbaxError(
            f"orbax-checkpoint {version} is installed, but the Orbax integration of "
            f"orbax_safetensors supports orbax-checkpoint{SUPPORTED_RANGE}: pip install "
            f"'orbax-checkpoint{SUPPORTED_RANGE}' (ost.save / ost.load work with any version)")
