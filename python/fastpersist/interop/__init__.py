"""Other formats: :mod:`.convert` (torch.save and safetensors files to and from fastpersist
checkpoints), :mod:`.torchfile` (``fp.torch_save``: files ``torch.load`` reads, written with
the engine; :mod:`.torchroutes`: its arguments, and what goes to ``torch.save`` itself) and
:mod:`.torchasync` (``fp.torch_save_async``: the same file, written in the background)."""
