"""The in-memory level, in one place (docs/levels.md): a root on a memory filesystem (tmpfs, e.g.
under ``/dev/shm``) whose retired steps' data files are recycled, not freed, and overwritten in
place by the next save.

* :mod:`~fastpersist.memory_level.recycle`: which files are recycled, how a save takes them,
  and why that stays crash-safe;
* :mod:`~fastpersist.memory_level.spares`: until a step retires (a run's first ``keep`` saves),
  files for the next save made while the training step runs, taken as recycled ones are;
* :mod:`~fastpersist.memory_level.reader_locks`: the shared locks a reader holds so that no
  file it reads is recycled under it.

The engine's side is one Rust folder, ``rust/fastpersist-core/src/job/memory/`` (a job that
overwrites recycled files through mappings; a spare file made ready ahead; a device save whose
arena is the file itself). Only
the arena kept over a recycled file lives elsewhere: ``gpu/arenas.py`` (``Arenas.lease_file``),
because it shares the arenas' bound (``Config.pinned_bytes``) and their leasing.
"""
