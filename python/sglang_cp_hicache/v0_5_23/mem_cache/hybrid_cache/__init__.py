"""The plugin's pieces around ``sglang.srt.mem_cache.hybrid_cache``."""
