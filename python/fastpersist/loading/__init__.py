"""The load pipeline: :mod:`.pipeline` orders the steps of ``fp.load``; :mod:`.opened` reads
one checkpoint through one directory handle, :mod:`.relocate` finds moved stripe directories,
:mod:`.reading` reads the stream with O_DIRECT, :mod:`.fill` fills ``out=`` by key,
:mod:`.maplocation` places tensors, :mod:`.todevice` loads to a GPU through pinned windows,
:mod:`.shared_read` shares a replicated read across ranks, :mod:`.phases` times it all;
:mod:`.examine` is ``fp.inspect`` and ``fp.verify``."""
