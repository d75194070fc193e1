"""The run's report: per-rank results of every column in, ``SimReport`` out (``build``),
its records (``records``, with the ``balance``, ``pd`` and ``storage`` summaries and a
column's checks in ``columns``) and the human-readable table (``table``)."""
