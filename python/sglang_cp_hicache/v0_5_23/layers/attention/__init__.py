"""Attention extensions of the 0.5.23 line (mirrors ``sglang.srt.layers.attention``)."""
