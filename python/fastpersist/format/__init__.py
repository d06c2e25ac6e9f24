"""The on-disk format, and the only code that knows it (docs/format.md).

* :mod:`.layout`: every name fastpersist gives a file or directory, the patterns that
  recognise them, and the atomic small-file write;
* :mod:`.flocks`: the ``flock`` primitives that tell a live writer from a dead one;
* :mod:`.ownership`: stripe directories' owner markers and live saves' locks;
* :mod:`.flatten` / :mod:`.unflatten`: a state to and from a tree spec, records and blobs
  (:mod:`.records`, :mod:`.blobs`, :mod:`.values` for plain leaves, :mod:`.kinds` for sparse tensors,
  tensor attributes, sets, bytearrays and meta tensors);
* :mod:`.nativewalk`: what flatten's native walk in ``_core`` reads; :mod:`.refusals`: why a value cannot be saved;
* :mod:`.manifest`: writing and strictly validating the manifest, within :mod:`.limits`; :mod:`.seal`:
  its checksum of its own bytes; :mod:`.chunkmap`: which file chunks hold which chunks of the stream
  (format 2.0) and each chunk's content hash;
* :mod:`.confine`: what a manifest may make a reader open or a remover delete;
* :mod:`.quote`: bounded quoting of untrusted values in messages.
"""
