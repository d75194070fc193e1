"""Write path under CP shared KV: logical ``out_cache_loc`` -> this rank's physical locs.

Translated once per forward, before the layer loop, so every KV writer (the pool API, the
fused MLA rope+cache kernel, the fused indexer K store) runs unchanged and stores only the
tokens this rank owns:

* an owned token goes to its physical loc (``CpSharedKVLayout.logical_locs_to_physical``);
* a token owned by another rank goes to the same offset of physical page 0, SGLang's
  reserved padding page, which no reader ever addresses.

Everything is elementwise on the device: no host sync, no data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout


def translate_out_cache_loc(
    layout: CpSharedKVLayout, logical_locs: torch.Tensor
) -> torch.Tensor:
    """Physical write loc of each logical loc (padding page 0 when not owned); same dtype.

    The mapping is the layout's (the one place of device-side translation)."""
    return layout.physical_write_locs(logical_locs)


@dataclass(frozen=True)
class WritePathLocs:
    """The batch's write locs in both spaces.

    Invariant: ``physical`` has the shape and dtype of ``logical``; consumers that index
    by logical loc (req_to_token, capturers, PD transfer) keep using ``logical``.
    """

    logical: torch.Tensor
    physical: torch.Tensor

    @classmethod
    def build(cls, layout: CpSharedKVLayout, logical_out_cache_loc: torch.Tensor) -> "WritePathLocs":
        return cls(
            logical=logical_out_cache_loc,
            physical=translate_out_cache_loc(layout, logical_out_cache_loc),
        )
