"""Scheduler-side hooks (mirrors ``sglang.srt.managers``): prefill admission under CP
shared KV (:mod:`.schedule_policy`)."""
