"""The command line (``fastpersist ...``). Its modules may import the whole library; nothing in the library imports
them.

* :mod:`.cli`: the parser and its commands; its helpers :mod:`.clitools` (``inspect``, ``convert`` and ``export``,
  progress bars) and :mod:`.units` (sizes such as ``1GiB``);
* :mod:`.rootinfo`: ``fastpersist inspect ROOT`` for a Checkpointer root: its steps, and what each holds on each level;
* :mod:`.demo`: ``fastpersist demo``, fastpersist against torch.save and safetensors on one training state;
* :mod:`.tune`: ``fastpersist tune``, each directory's device measured and its best settings cached; :mod:`.sweep`:
  the measuring behind it;
* :mod:`.advise`: ``fastpersist advise``; :mod:`.bench`: ``fastpersist bench``.
"""
