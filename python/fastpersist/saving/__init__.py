"""The save pipeline.

* :mod:`.start`: which job a save runs (``save_blocking``: ``fp.save``'s whole save);
* :mod:`.job`: one process's share (flatten, plan, stage and write in Rust, commit); :mod:`.share_layout`: where that
  share goes, the plan's parts it writes, the state flattened as a save flattens it;
* :mod:`.group`: a process group's save over :mod:`fastpersist.distributed.control`; :mod:`.partner_copies`: a group
  save whose every node commits its own copy, with copies of its partners' shares;
* :mod:`.target`: what a save may replace, and the manifest write; :mod:`.verdict`: one outcome per save;
  :mod:`.engine_save`: staged, wait and cancel of a save the engine writes (a job here, ``torch_save_async``'s);
* :mod:`.incremental`: ``fp.Incremental``: which chunks changed since the base step, the packed stream of them
  that the engine writes, and the base's files linked for the rest;
* :mod:`.commit`: the one commit sequence of every host's checkpoint: wait for its saves, agree, publish, retire;
* :mod:`.pools`: the staging pools kept between saves; :mod:`.optimizer_guard`: the hook that makes
  ``optimizer.step()`` wait;
* :mod:`.in_flight`: a Checkpointer's saves in flight, one writing and one snapshot waiting behind a write gate;
* :mod:`.remover`: deletes replaced trees and retired steps after the commit, on a background thread;
  :mod:`.leftovers`: which stripe and temporary directories are provably leftovers (the deletion rule).
"""
