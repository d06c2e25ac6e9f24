"""Helpers that wire fastpersist into training loops and frameworks, and :func:`guard_optimizer` (defined in
:mod:`fastpersist.saving.optimizer_guard`, below the Checkpointer that uses it).

* :mod:`.dcp`: the torch.distributed.checkpoint storage plug-in; :mod:`.dcp_args`: ``FileSystemWriter``'s and
  ``FileSystemReader``'s arguments as a Config; :mod:`.dcp_ranges`: which chunks a load plan needs;
  :mod:`.dcp_metadata`: ``.metadata`` read with an allow-list; :mod:`.dcp_staging`: ``dcp.async_save``'s staging
  into an arena; :mod:`.dcp_source`: a DCP checkpoint as the Hugging Face export reads it;
* :mod:`.torchtitan`: torchtitan's ``CheckpointManager`` over the DCP plug-in;
* :mod:`.hf_trainer`: Hugging Face ``Trainer`` checkpoints overlapped with training; :mod:`.hf_checkpoint`: their
  staging directory, renamed into place once every rank's files are durable;
* :mod:`.hf_accelerate`: Accelerate's ``save_state``/``load_state`` through its hooks;
* :mod:`.lightning`: PyTorch Lightning ``CheckpointIO`` plug-ins;
* :mod:`.deepspeed`: DeepSpeed's ``CheckpointEngine``: torch.save-format files, ``latest`` once every rank is durable;
  :mod:`.deepspeed_staging`: a re-saved tag's staging directory, swapped in at the commit;
* :mod:`.nvrx`: NVRx's local checkpoint manager, each rank's checkpoint stored by fastpersist.

:mod:`.torchtitan`, :mod:`.hf_trainer`, :mod:`.lightning`, :mod:`.deepspeed` and :mod:`.nvrx` import their framework:
import each only where that framework is installed.
"""

from __future__ import annotations

from ..saving.optimizer_guard import guard_optimizer

__all__ = ["guard_optimizer"]
