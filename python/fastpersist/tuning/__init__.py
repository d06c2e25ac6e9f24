"""Per-device settings: ``fastpersist tune`` measures, ``Config(..."auto")`` uses.

* :mod:`.identity`: which device a directory is on (the cache's key and identity);
* :mod:`.cache`: the JSON cache of best settings and figures per device;
* :mod:`.sweep`: the bounded sweep of chunk size x queue depth, writes and reads;
* :mod:`.resolve`: ``"auto"`` made concrete where a save or load begins (never a sweep).

``fastpersist tune`` itself is :mod:`fastpersist.tools.tune`; see docs/performance.md.
"""
