"""Our handlers join Orbax's registries whenever Orbax is loaded, and never load it themselves.

Orbax restores a step without arguments (``mngr.restore(step)`` on a fresh manager,
``ocp.v1.load_checkpointables(step)``) through the handler typestrs the step records, looked
up in registries that only importing our handler modules fills (``orbax_shim``). Those modules
import Orbax, which costs about half a second on top of JAX and would be paid by every
``import orbax_safetensors``, though ``ost.save``/``ost.load`` and the CLI never need it. And a
restore without arguments touches no name of ours, so registering when an Orbax name of
``ost`` is first used (its module ``__getattr__``) would come too late for it. So registration
follows Orbax instead:

* Orbax already loaded when ``orbax_safetensors`` is imported: registration happens then,
  costing only our own modules.
* Otherwise a finder first on ``sys.meta_path`` waits for ``orbax.checkpoint``, registers once
  it has executed, whoever imported it, and leaves ``sys.meta_path``. Importing both packages,
  in either order, is all a restore without arguments needs, as it was when importing ours
  imported Orbax.

Our Orbax-facing modules (``integrations.orbax_*``) are often what imports Orbax first (touching
``ost.SafetensorsSave`` does), and registering imports them: run from inside their own import of
Orbax, it would find them half-executed. So the finder follows their imports as well, and
registers only when the outermost of this thread's imports of them and of ``orbax.checkpoint``
has finished.

The trade-offs, accepted because the alternatives cost every user the import or break
restores without arguments:

* until Orbax is imported, every import in the process asks one more finder (a string test);
* the first ``import orbax.checkpoint`` after ``orbax_safetensors`` also imports our Orbax
  modules (their own cost, tens of milliseconds), whether or not the process uses them;
* registration runs inside that import, so were it to fail, the import of Orbax would raise;
* one thread's first import of Orbax racing another's first use of an Orbax name of ``ost``
  is a circular import between threads, which Python may answer with a half-executed module;
* the modules it follows are executed by their own loaders, called from ours: a module's
  ``__loader__`` and ``__spec__.loader`` are its own loader again before its code runs.

With an Orbax outside the supported range nothing registers: Orbax is left as it is and
touching an Orbax name of ``ost`` raises ``UnsupportedOrbaxError``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

from orbax_safetensors.errors import UnsupportedOrbaxError
from orbax_safetensors.integrations.orbax_version import check_orbax_version

_ORBAX = "orbax.checkpoint"
_OURS = "orbax_safetensors.integrations.orbax_"  # the modules of ours that import Orbax


def register_with_orbax() -> None:
    """Registers our handlers with Orbax now if it is loaded, else once it is."""
    if _ORBAX in sys.modules:
        _register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _register() -> None:
    with contextlib.suppress(ValueError):  # another thread may have registered meanwhile
        sys.meta_path.remove(_FINDER)
    try:
        check_orbax_version()
    except UnsupportedOrbaxError:
        return
    import orbax_safetensors.integrations.orbax_shim  # noqa: F401  (importing registers)


class _Finder:
    """Finds nothing itself: hands Orbax's and our Orbax-facing modules to the finders after it,
    their loaders wrapped so that registration follows the outermost import."""

    def __init__(self) -> None:
        self.importing = threading.local()  # depth: imports of this thread under way

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _ORBAX and not name.startswith(_OURS):
            return None
        try:
            later = sys.meta_path[sys.meta_path.index(self) + 1:]
        except ValueError:  # registered and removed by another thread meanwhile
            return None
        for finder in later:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(name, path, target) if find_spec is not None else None
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None


class _Loader:
    """``loader``, counting the imports under way, then registering after the outermost."""

    def __init__(self, loader: Any, finder: _Finder) -> None:
        self._loader, self._finder = loader, finder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)  # create_module, get_code, is_package, ...

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self._loader
        importing = self._finder.importing
        importing.depth = getattr(importing, "depth", 0) + 1
        try:
            self._loader.exec_module(module)
        finally:
            importing.depth -= 1
        if importing.depth == 0 and _ORBAX in sys.modules:
            _register()


_FINDER = _Finder()
