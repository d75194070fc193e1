"""The plugin's pieces around SGLang 0.5.23's ``sglang.srt.mem_cache.unified_cache``."""
