"""The I/O layer: checkpoint formats in, models and policy state out; imports nothing itself.

- :mod:`.st`: the safetensors format with the standard library only (headers, positional reads and
  writes, fsync, the weights hash); the apply side of patches and the device agent use it alone.
- :mod:`.checkpoints` (dense checkpoints: safetensors, sharded, legacy ``.bin``),
  :mod:`.input_formats` (format rules), :mod:`.s3_checkpoint` (checkpoints read in place from
  object storage), :mod:`.expert_readers` (experts as task vectors, dense or PEFT LoRA).
- :mod:`.writers` (staged, sharded safetensors output), :mod:`.state` (the policy state folder).

Importing this package loads none of them, so ``mergestream.io.st`` stays free of torch.
"""
