"""The parts of ``CheckpointManager`` (``shardckpt._manager``), each testable alone.

* ``retention``: step names, what retention keeps (pure plans), and the
  deletions and ``gc`` on the root that keep every kept step whole;
* ``restore``: restore order (which step, damage vs storage trouble, why nothing);
* ``owners``: one manager per root (another writer's steps);
* ``memory``: the glue to the memory tier;
* ``exports``: the last save's exports (model only, ``export_dtype``, Hugging Face).

The manager class keeps the lifecycle, argument checks and the cross-rank
agreements; the local/remote tiers are ``shardckpt._flush``'s.
"""

__all__: list = []
