"""The save path: a PyTree of arrays → a safetensors checkpoint, every process writing its own bytes.

One vocabulary: a save has *options*, a write *session*, host *shards* and
write *strategies*. A save walks these rooms in order:

1. ``save``: the call's ``SaveOptions`` resolved once (``options``), the tree's
   names and shapes checked.
2. ``host_shards``: this process's part of the tree, mapped to stored
   tensors; on accelerators ``device_copies`` brings it to the host a window
   ahead of the writes.
3. ``session``: the location taken, the write planned, written and committed
   across processes (its docstring numbers those steps).
4. ``strategies``: how this process's bytes reach the files, chosen once from
   what the storage backend declares.
"""
