"""The 0.5.23 line's CPU runtime (``runtime``), its gloo shard group (``shard_group``) and
the builder of one rank's real 0.5.23 cache stack (``stack``)."""
