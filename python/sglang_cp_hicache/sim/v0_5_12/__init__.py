"""The simulator's driver for the SGLang 0.5.12.post1 line: rank entry points (``rank``),
the scheduler-path driver (``driver``) over ``testing.v0_5_12.nsa_stack``, its observers,
checks, invariants and planted faults. Imports nothing of the 0.5.23 line."""
