"""The command line (``fastpersist ...``): :mod:`.cli` and its helpers :mod:`.clitools` and
:mod:`.units`, :mod:`.advise` (``fastpersist advise``) and :mod:`.bench` (``fastpersist
bench``). They may import the whole library; nothing in the library imports them."""
