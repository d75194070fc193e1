"""Repository-wide pytest set-up: the CPU runtime must be in place before SGLang is imported."""

from sglang_cp_hicache.testing import install

install()
