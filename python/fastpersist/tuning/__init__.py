"""Per-device settings: what ``fastpersist tune`` stored, and what ``Config(..."auto")`` resolves to.

* :mod:`.identity`: which device a directory is on (the cache's key and identity);
* :mod:`.cache`: the JSON cache of best settings and figures per device;
* :mod:`.resolve`: ``"auto"`` made concrete where a save or load begins (never a sweep);
* :mod:`.defaults`: what an untuned ``"auto"`` resolves to.

This package sits below :mod:`fastpersist.config` (``Config.resolved_for`` calls
:mod:`.resolve`), so it imports no Config. The measuring itself runs the engine and the
loader, above both: the sweep is :mod:`fastpersist.tools.sweep`, ``fastpersist tune``
:mod:`fastpersist.tools.tune`; see docs/performance.md.
"""
