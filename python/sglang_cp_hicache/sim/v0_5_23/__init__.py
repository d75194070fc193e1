"""The simulator's driver for the SGLang 0.5.23 line: rank entry points and the line's
limits (``rank``), the PD-prefill scheduler loop over the real 0.5.23 cache stack
(``driver``, over ``testing.v0_5_23.stack``), its observers, checks, invariants and planted
faults. Imports nothing of the 0.5.12.post1 line."""
