"""The fleet's capacity: N prefill instances behind one router over one shared L3 store
against N with node-local stores (``--instances``, ``--router``; docs/simulator.md,
"Fleet"). A page-level model of each instance's tiers over the simulator's workload, in
the parent process: it imports no SGLang and runs no rank (the single-instance run is the
real stack's proof; this one measures what sharing the store adds).
"""
