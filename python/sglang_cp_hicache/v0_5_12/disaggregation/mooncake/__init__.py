"""Mooncake transfer backend under CP shared KV (mirrors ``sglang.srt.disaggregation.mooncake``)."""
