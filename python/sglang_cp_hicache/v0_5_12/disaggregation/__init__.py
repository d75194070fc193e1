"""PD disaggregation under CP shared KV (mirrors ``sglang.srt.disaggregation``)."""
