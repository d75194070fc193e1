"""The MTP draft's bytes in L3 objects, read back and checked against the reference's.

0.5.23 packs the EAGLE draft's KV and DSA indexer rows as tail layers of the target's host
slots (upstream's PACKED mode), so every L3 object of a page, KV and indexer alike, holds
``target_layers + draft_layers`` layers, the draft's last. A KV object is layer-major
(``[layer][token][dim]``) from a ``layer_first`` host pool and token-major
(``[token][layer][dim]``) from a ``page_first`` one; an indexer object is layer-major from
both (``[layer][page bytes]``). Objects are told apart by size, pages by the 64-hex page hash
their keys hold (``store_view.page_of``), the same for the sharded and the reference server
over the same tokens.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

from sglang_cp_hicache.testing.server.store_view import PAGE_HASH, page_of

KV = "kv"
INDEXER = "indexer"
BF16_BYTES = 2
INDEXER_SCALE_BYTES = 4  # one fp32 scale per token beside its fp8 key


@dataclass(frozen=True)
class PageGeometry:
    """One page's L3 object sizes: ``layers`` host layers (the target's, then the draft's)."""

    page_size: int
    target_layers: int
    draft_layers: int
    kv_bytes_per_token: int  # per layer
    indexer_bytes_per_token: int  # per layer

    @property
    def layers(self) -> int:
        return self.target_layers + self.draft_layers

    def kind(self, size: int) -> Optional[str]:
        """``KV`` or ``INDEXER`` for an object of ``size`` bytes holding every host layer."""
        for kind, per_token in ((KV, self.kv_bytes_per_token), (INDEXER, self.indexer_bytes_per_token)):
            if size == self.layers * self.page_size * per_token:
                return kind
        return None

    def layer_major(self, kind: str, data: bytes, token_major_kv: bool) -> List[bytes]:
        """``data``'s layers, host layer order (a token-major KV object regathered)."""
        per_layer = len(data) // self.layers
        if kind == INDEXER or not token_major_kv:
            return [data[i * per_layer : (i + 1) * per_layer] for i in range(self.layers)]
        row = self.kv_bytes_per_token
        tokens = [data[t * self.layers * row : (t + 1) * self.layers * row] for t in range(self.page_size)]
        return [b"".join(token[i * row : (i + 1) * row] for token in tokens) for i in range(self.layers)]

    def describe(self, size: int) -> str:
        return (
            f"{size} bytes is no page of {self.layers} layers ({self.target_layers} target + "
            f"{self.draft_layers} draft): KV {self.layers * self.page_size * self.kv_bytes_per_token}, "
            f"indexer {self.layers * self.page_size * self.indexer_bytes_per_token}"
        )


def geometry_of(spec, page_size: int) -> PageGeometry:
    """The tiny checkpoint ``spec``'s (``TinyDsaSpec``) pages: bf16 MLA latent and rope
    rows, fp8 indexer keys with their scale."""
    return PageGeometry(
        page_size=page_size,
        target_layers=spec.num_hidden_layers,
        draft_layers=spec.num_nextn_predict_layers,
        kv_bytes_per_token=(spec.kv_lora_rank + spec.qk_rope_head_dim) * BF16_BYTES,
        indexer_bytes_per_token=spec.index_head_dim + INDEXER_SCALE_BYTES,
    )


def file_objects(folder: Path) -> Dict[str, bytes]:
    """An L3 file tier's objects by key (``<key>.bin``), those whose key holds a page hash."""
    if not folder.exists():
        return {}
    return {path.stem: path.read_bytes() for path in folder.rglob("*.bin") if PAGE_HASH.search(path.stem)}


def file_keys(folder: Path) -> Set[str]:
    return {path.stem for path in folder.rglob("*.bin") if PAGE_HASH.search(path.stem)} if folder.exists() else set()


def _by_page_and_kind(
    objects: Mapping[str, bytes], geometry: PageGeometry, problems: List[str], side: str
) -> Dict[Tuple[str, str], List[bytes]]:
    found: Dict[Tuple[str, str], List[bytes]] = defaultdict(list)
    for key, data in sorted(objects.items()):
        kind = geometry.kind(len(data))
        if kind is None:
            problems.append(f"{side} object {key}: {geometry.describe(len(data))}")
            continue
        found[(page_of(key), kind)].append(data)
    return found


@dataclass(frozen=True)
class DraftCheck:
    """What :func:`check_draft_bytes` found: problems (empty: every page's draft is there and
    equal to the reference's) and the pages and objects it read."""

    problems: Tuple[str, ...]
    pages: int
    objects: int


def check_draft_bytes(
    sharded: Mapping[str, bytes],
    reference: Mapping[str, bytes],
    pages: Iterable[str],
    geometry: PageGeometry,
    token_major_kv: bool = False,
) -> DraftCheck:
    """For every page in ``pages``: the sharded side stored one KV and one indexer object
    (its owner's), each of every host layer; its draft layers hold bytes (not all zero) and
    equal the reference's draft layers of that page, and its target layers the reference's
    (``reference``: layer-major objects, one per page and kind on each of its ranks)."""
    problems: List[str] = []
    ours = _by_page_and_kind(sharded, geometry, problems, "sharded")
    theirs = _by_page_and_kind(reference, geometry, problems, "reference")
    pages = sorted(set(pages))
    objects = 0
    for page in pages:
        for kind in (KV, INDEXER):
            stored = ours.get((page, kind), [])
            if len(stored) != 1:
                problems.append(f"page {page[:12]}: {len(stored)} sharded {kind} objects, want 1")
                continue
            objects += 1
            layers = geometry.layer_major(kind, stored[0], token_major_kv)
            draft = layers[geometry.target_layers :]
            if all(not any(layer) for layer in draft):
                problems.append(f"page {page[:12]}: the draft's {kind} layers are all zero in the sharded object")
            want = theirs.get((page, kind), [])
            if not want:
                problems.append(f"page {page[:12]}: no reference {kind} object to compare")
                continue
            reference_layers = geometry.layer_major(kind, want[0], False)
            if draft != reference_layers[geometry.target_layers :]:
                problems.append(f"page {page[:12]}: the draft's {kind} bytes differ from the reference's")
            if layers[: geometry.target_layers] != reference_layers[: geometry.target_layers]:
                problems.append(f"page {page[:12]}: the target's {kind} bytes differ from the reference's")
    return DraftCheck(tuple(problems), len(pages), objects)


__all__ = [
    "DraftCheck",
    "INDEXER",
    "KV",
    "PageGeometry",
    "check_draft_bytes",
    "file_keys",
    "file_objects",
    "geometry_of",
]
