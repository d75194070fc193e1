"""The 0.5.23 line's layer extensions (mirrors ``sglang.srt.layers``)."""
