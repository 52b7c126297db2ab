"""Streams: one checkpoint read block by block into another, or checked whole.

- ``consolidate``: any checkpoint we read → the HF layout, through a save's
  write session; ``BlockSource`` is what a stream reads from.
- ``mapped_blocks``: a block source seen through an ``ost.Mapping`` (both
  directions), what ``convert`` streams.
- ``verify``: every file's headers and checksums, every problem collected.

A stream reads with the load path's execution and writes with the save path's
session; it is the one room that builds on both.
"""
