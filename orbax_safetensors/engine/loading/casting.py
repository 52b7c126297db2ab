"""The cast policy of a load: which conversions to the target's dtypes it makes, and how.

numpy's ``astype`` changes values without a word (-300.0 into int8 is -44),
so every cast a load makes goes through here (``LoadOptions.casting``):

1. ``cast_rule``, at plan time, per tensor: the ``Cast`` to the result's
   dtype, from the values the mapping's transform leaves (float32 once
   scaled): refused (float → int: ``format.dtypes.cast_kind``), checked (a
   narrowing int cast, a float of smaller range: each shard's values must
   fit), or plain.
2. ``refuse_casts``, before any read: every refused cast of a load in one
   ``SafetensorsError``.
3. ``apply_cast``, as each shard is read: the check, then ``astype``.

``device_dtype`` is the dtype a ``jax.Array`` gets (32-bit for 64-bit without
``jax_enable_x64``): casts to it happen here, on the host, under the policy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable

import jax
import numpy as np

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format.dtypes import cast_kind, first_out_of_range
from orbax_safetensors.planning import TensorSource
from orbax_safetensors.planning.transforms import Transform

_UNSAFE_HINT = ('pass options=ost.LoadOptions(casting="unsafe") to cast as numpy astype does '
                "(truncating, wrapping around)")


@dataclasses.dataclass(frozen=True)
class Cast:
    """What a load does to a tensor's values on their way to a result of dtype ``to``
    (``None``: as read). ``refused``: the cast the policy refuses, described for
    ``refuse_casts``. ``check``: raises unless every value it is given fits ``to``."""

    to: np.dtype | None
    refused: str | None = None
    check: Callable[[np.ndarray], None] | None = None


def device_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a ``jax.Array`` of ``dtype`` has: without ``jax_enable_x64``, JAX makes
    64-bit types 32-bit, wrapping values around; cast on the host instead, under the policy."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def cast_rule(name: str, source: TensorSource, transform: Transform | None, to: np.dtype | None,
              casting: str, leaf: str | None = None) -> Cast:
    """What ``casting`` makes of casting tensor ``name`` (part of tree leaf ``leaf``, if
    given) to ``to``: refused, checked on the values read, or plain."""
    if to is None or casting == "unsafe":
        return Cast(to)
    stored = source.dtype.numpy
    values = stored if transform is None else transform.tree_dtype(stored)
    kind = cast_kind(values, to)
    file = source.slices[0].file if source.slices else None
    if kind == "unsafe":
        where = f" in {file.rsplit('/', 1)[-1]}" if file else ""
        scaled = "" if values == stored else f" ({values} once scaled)"
        part = "" if leaf is None else f" (part of {leaf!r})"
        return Cast(to, refused=f"{name!r}{part}{where}: stored {stored}{scaled}, target {np.dtype(to)}")
    if kind == "check_range":
        return Cast(to, check=functools.partial(_check_range, name, file, np.dtype(to)))
    return Cast(to)


def apply_cast(values: np.ndarray, cast: Cast) -> np.ndarray:
    """``values`` as ``cast`` makes them: unchanged when of its dtype, else checked and cast."""
    if cast.to is None or values.dtype == cast.to:
        return values
    if cast.check is not None:
        cast.check(values)
    with np.errstate(over="ignore", invalid="ignore"):  # checked above, or asked for (unsafe)
        return values.astype(cast.to)


def refuse_casts(refused: Iterable[str]) -> None:
    """Raises ``SafetensorsError`` listing every refused cast (``Cast.refused``), if any."""
    refused = list(dict.fromkeys(refused))
    if refused:
        raise SafetensorsError(
            f"refusing to cast {len(refused)} tensor(s) to a target dtype that changes their "
            "values (float → int truncates; NaN and inf become arbitrary integers): "
            + "; ".join(refused) + f". Give the target the stored dtype, or {_UNSAFE_HINT}")


def _check_range(name: str, file: str | None, target: np.dtype, values: np.ndarray) -> None:
    """Raises unless every one of the integer ``values`` read fits ``target``. Where the target
    is the 32-bit type JAX makes of a 64-bit one (without ``jax_enable_x64``), an unsafe cast
    would wrap the value around: the hint is 64-bit JAX or a host array instead."""
    bad = first_out_of_range(values, target)
    if bad is not None:
        hint = _UNSAFE_HINT
        if values.dtype.itemsize == 8 and target == device_dtype(values.dtype) != values.dtype:
            hint = ('JAX holds 64-bit integers as 32-bit unless jax_enable_x64 is on: call '
                    'jax.config.update("jax_enable_x64", True) before building the target, or '
                    'load the tensor as a host numpy array (a target leaf without a sharding); '
                    'casting="unsafe" would wrap the value around')
        raise SafetensorsError(
            f"value {bad} (stored {values.dtype}) does not fit the target dtype {target}: "
            f"refusing a cast that changes it; {hint}", file=file, tensor=name)
