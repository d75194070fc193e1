"""Imported once by the forkserver: the CPU runtime first, then the installed line's cache stack."""

from sglang_cp_hicache.testing import install, warm_import

install()
warm_import()  # warm import for forked ranks
