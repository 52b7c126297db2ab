"""The engine's shared core: what a load, a save and a stream each stand on.

The loading, saving and streams paths never import one another's insides
except through here (streams, which read one checkpoint and write another,
build on both paths' entry points). Each module owns one thing:

- ``catalog``: what checkpoint is at a location (its kind, files, headers).
- ``coordination``: agreement between processes without device collectives.
- ``operation``: one write's steps agreed across processes, cancelled, committed once.
- ``pending``: background work's futures, at exit and when nobody waits.
- ``progress``: the one progress line of a long job.
- ``integrity``: bytes checked against the block checksums their files store.
- ``resharding``: shardings as storage sees them (which boxes each process holds).
- ``tree_names``: PyTree leaves ↔ tensor names.
- ``options``: every operation's options as one value or as keywords, resolved one way;
  the memory budgets' defaults.
- ``gc_pause``, ``option_checks``: small helpers each path uses the same way.
"""
