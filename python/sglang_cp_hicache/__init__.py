"""SGLang plugin: NSA prefill context-parallel shared KV together with HiCache."""

__version__ = "0.1.0"
