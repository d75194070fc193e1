"""Around ``sglang.srt.disaggregation.common``."""
