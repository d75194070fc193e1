"""The plugin's pieces around ``sglang.srt.mem_cache.storage.mooncake_store``."""
