"""Other formats.

* :mod:`.convert`: torch.save and safetensors files to and from fastpersist checkpoints;
* :mod:`.torchfile`: ``fp.torch_save``, files ``torch.load`` reads, written with the engine; :mod:`.torchroutes`: its
  arguments, and what goes to ``torch.save`` itself; :mod:`.ziprecords`: where the archive's zip records and their
  CRC-32 fields lie;
* :mod:`.torchasync`: ``fp.torch_save_async``, the same file, written in the background;
* :mod:`.hfexport`: ``fp.export_hf``'s work, a checkpoint (or any source) as Hugging Face safetensors shards;
  :mod:`.hfsources`: a checkpoint's named tensors, read window by window; :mod:`.hfshards`: the shard plan, the shard
  files and the index.
"""
