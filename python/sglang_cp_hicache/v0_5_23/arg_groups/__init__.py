"""The plugin's hooks into SGLang 0.5.23's ``sglang.srt.arg_groups`` (server-args resolution)."""
