"""What both SGLang lines share: pure logic that imports no SGLang (the import-graph test holds
this). Layout arithmetic, the forward-reservation state machine, the per-layer backup
pipeline, the ack watcher, the post-import watcher, the release table."""
