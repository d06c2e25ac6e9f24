"""Other formats: :mod:`.convert` (torch.save and safetensors files to and from fastpersist
checkpoints) and :mod:`.torchfile` (``fp.torch_save``: files ``torch.load`` reads, written
with the engine)."""
