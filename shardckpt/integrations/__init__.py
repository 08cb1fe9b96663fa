"""One-line switches for the trainers FSDP2 users train with.

Each trainer has its own module, imported only when used (the trainer is an
optional dependency; importing ``shardckpt.integrations`` imports none of them):

* ``shardckpt.integrations.accelerate``: ``enable(accelerator)`` makes
  ``Accelerator.save_state`` / ``load_state`` write and read shardckpt
  checkpoints (docs/integrations/accelerate.md).
* ``shardckpt.integrations.transformers``: ``enable(trainer)`` makes a
  Hugging Face ``Trainer``'s checkpoints (FSDP2 through Accelerate)
  shardckpt checkpoints, resumed by ``train(resume_from_checkpoint=...)``
  (docs/integrations/transformers.md).
* ``shardckpt.integrations.lightning``: ``ModelParallelStrategy`` for the
  Trainer and ``FabricModelParallelStrategy`` for Fabric, Lightning's own
  strategies with a shardckpt sharded checkpoint (docs/integrations/lightning.md).
* ``shardckpt.integrations.torchtitan``: ``CheckpointManager``, a drop-in
  for torchtitan's (docs/integrations/torchtitan.md).
"""

from __future__ import annotations

__all__ = ["accelerate", "lightning", "torchtitan", "transformers"]
