"""The SGLang 0.5.12.post1 line: every hook, pool and cache delta for that release, mirroring
its module tree. Never imports the 0.5.23 line (nor does that line import this one)."""
