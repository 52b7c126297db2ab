"""The one exception type every rejection of a checkpoint raises.

Callers catch a single class (it is a ``ValueError``, so code written against
``safetensors`` keeps working) and still learn *where* the problem is: the
message always names the file, and the tensor when one is involved.
"""

from __future__ import annotations


class SafetensorsError(ValueError):
    """A file, index or request that does not follow the safetensors rules."""

    def __init__(
        self, message: str, *, file: str | None = None, tensor: str | None = None
    ):
        self.file = file
        self.tensor = tensor
        self.reason = message
        where = []
        if file is not None:
            where.append(f"file {file!r}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
