"""SGLang's own servers on a CPU-only box, for tests and the serving demo (test-only).

* :mod:`.runtime` and ``testing/<line>/server_runtime.py``: the CPU server runtime, applied
  to the server processes the harness starts (never by the installed plugin);
* :mod:`.tiny_model`: a tiny GLM-5-shaped DSA checkpoint made locally from a seed;
* :mod:`.processes`, :mod:`.launch` (+ ``testing/<line>/server_launch.py``), :mod:`.cluster`,
  :mod:`.session`: the PD cluster (prefills, decode, router, Mooncake master) and its lifecycle;
* :mod:`.client`, :mod:`.metrics`, :mod:`.scenarios`: requests, comparisons, what each
  scenario must show; :mod:`.cli`: ``python -m sglang_cp_hicache.testing.server``.
"""
