"""The save pipeline: :mod:`.start` picks the job, :mod:`.job` is one process's share
(flatten, plan, stage and write in Rust, commit), :mod:`.group` a process group's save over
:mod:`fastpersist.distributed.control`, :mod:`.target` what a save may replace and the
manifest write, :mod:`.verdict` one outcome per save, :mod:`.pools` the staging pools kept
between saves, :mod:`.optimizer_guard` the hook that makes ``optimizer.step()`` wait."""
