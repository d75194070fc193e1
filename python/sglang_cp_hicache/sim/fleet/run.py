"""``run_fleet``: N prefill instances behind one router, over one shared L3 store or each
over its own node-local store (imports no SGLang).

Time runs in rounds: each instance prefills up to ``batch_size`` requests per round, the
router assigning the trace's requests in order. Every lookup of a round (the router's, the
device / host match, the L3 query) sees the fleet as the round began; then each instance,
in order, takes its requests: the L3 run after its host match is read (a prefetch), the
rest computed and backed up to host and L3, a page already stored not written again
(counted: ``dedup_pages``). Two instances computing the same prefix in one round both
compute it; the later writer finds it stored. Each page moves on its owner rank
(``core.rotation.owner_of``) with the chain's rotation base, drawn per instance as new
chains start (in turn, as the allocator spreads new chains); bytes are whole pages of
every component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from sglang_cp_hicache.core.rotation import owner_of
from sglang_cp_hicache.core.storage_keys import StorageNamespace
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.fleet.router import Router
from sglang_cp_hicache.sim.fleet.store import KV_CACHE_DIM, L3Store, components, page_bytes
from sglang_cp_hicache.sim.fleet.tiers import InstanceTiers, page_hashes
from sglang_cp_hicache.sim.workload import Request


@dataclass
class InstanceMeters:
    """One instance's tokens by tier and L3 pages by owner rank."""

    cp_size: int
    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    written_pages: List[int] = field(default_factory=list)  # per owner rank
    read_pages: List[int] = field(default_factory=list)
    dedup_pages: int = 0  # computed pages found stored already: not written again

    def __post_init__(self) -> None:
        self.written_pages = self.written_pages or [0] * self.cp_size
        self.read_pages = self.read_pages or [0] * self.cp_size


@dataclass(frozen=True)
class FleetRun:
    """One fleet replay: ``shared`` one L3 store for all, else one store per instance."""

    instances: int
    router: str
    shared: bool
    page_bytes: int
    meters: Tuple[InstanceMeters, ...]
    stored_pages: int  # distinct pages over the fleet's store(s)

    def hit_rates(self) -> Dict[str, float]:
        """Fleet hit tokens / prompt tokens, by tier and together."""
        prompt = max(1, sum(m.prompt_tokens for m in self.meters))
        rates = {
            tier: sum(getattr(m, f"{tier}_hit_tokens") for m in self.meters) / prompt
            for tier in ("device", "host", "storage")
        }
        rates["all"] = sum(rates.values())
        return rates

    def written_bytes(self) -> List[int]:
        return [sum(m.written_pages) * self.page_bytes for m in self.meters]

    def read_bytes(self) -> List[int]:
        return [sum(m.read_pages) * self.page_bytes for m in self.meters]


@dataclass
class _Instance:
    tiers: InstanceTiers
    store: L3Store
    meters: InstanceMeters
    bases: Dict[str, int] = field(default_factory=dict)  # first page hash -> rotation base

    def base_of(self, chain: Sequence[str]) -> int:
        if chain and chain[0] not in self.bases:
            self.bases[chain[0]] = len(self.bases) % self.meters.cp_size
        return self.bases.get(chain[0], 0) if chain else 0


def _namespace(cfg: SimConfig) -> StorageNamespace:
    return StorageNamespace(
        model="sim-dsa", kv_dtype="bfloat16", kv_cache_dim=KV_CACHE_DIM, layer_num=cfg.layer_num,
        host_layout=cfg.mem_layout or "page_first", page_size=cfg.page_size,
    )  # fmt: skip


def _build(cfg: SimConfig, instances: int, shared: bool) -> List[_Instance]:
    parts = components(cfg.draft)
    shared_store = L3Store(_namespace(cfg), parts)
    return [
        _Instance(
            InstanceTiers.sized(cfg.cp_size, cfg.physical_tokens, cfg.hicache_ratio, cfg.page_size),
            shared_store if shared else L3Store(_namespace(cfg), parts),
            InstanceMeters(cfg.cp_size),
        )
        for _ in range(instances)
    ]


def _check_fits(requests: Sequence[Request], cfg: SimConfig) -> None:
    device_pages = cfg.cp_size * cfg.physical_tokens // cfg.page_size
    for request in requests:
        if len(request.token_ids) // cfg.page_size * cfg.batch_size > device_pages:
            raise ValueError(
                f"request {request.index} ({len(request.token_ids)} tokens) x batch size "
                f"{cfg.batch_size} does not fit an instance's {device_pages} device pages"
            )


# One lookup: (request, its page chain, device end, host end, L3 end), page indices.
_Lookup = Tuple[Request, List[str], int, int, int]


def _route_round(
    batch: Sequence[Request], fleet: List[_Instance], router: Router, cfg: SimConfig
) -> Dict[int, List[_Lookup]]:
    """Assign ``batch`` (``instances`` x ``batch_size`` requests at most) and look each up
    against the fleet as the round began."""
    taken: Dict[int, List[_Lookup]] = {i: [] for i in range(len(fleet))}
    for request in batch:
        chain = page_hashes(request.token_ids, cfg.page_size)
        matched = chain[: (len(request.token_ids) - 1) // cfg.page_size]  # match_prefix(input[:-1])
        open_instances = [i for i, got in taken.items() if len(got) < cfg.batch_size]
        chosen = router.pick(open_instances, lambda i: fleet[i].tiers.match(matched)[1])
        device_end, host_end = fleet[chosen].tiers.match(matched)
        storage_end = fleet[chosen].store.match(matched, host_end)
        taken[chosen].append((request, chain, device_end, host_end, storage_end))
    return taken


def _apply(instance: _Instance, lookup: _Lookup, now: int, page_size: int) -> None:
    """The request's prefill on its instance: hits counted, L3 read, new pages backed up."""
    request, chain, device_end, host_end, storage_end = lookup
    meters, cp = instance.meters, instance.meters.cp_size
    base = instance.base_of(chain)
    meters.requests += 1
    meters.prompt_tokens += len(request.token_ids)
    meters.device_hit_tokens += device_end * page_size
    meters.host_hit_tokens += (host_end - device_end) * page_size
    meters.storage_hit_tokens += (storage_end - host_end) * page_size
    for position in range(host_end, storage_end):
        meters.read_pages[owner_of(base, position, cp)] += 1
    for position in range(storage_end, len(chain)):
        if instance.store.put(chain[position]):
            meters.written_pages[owner_of(base, position, cp)] += 1
        else:
            meters.dedup_pages += 1
    instance.tiers.hold(chain, now)


def run_fleet(requests: Sequence[Request], cfg: SimConfig, instances: int, router: str, shared: bool) -> FleetRun:
    """Replay ``requests`` on ``instances`` prefill instances of ``cfg.cp_size`` ranks each."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    _check_fits(requests, cfg)
    fleet = _build(cfg, instances, shared)
    chooser = Router(router, instances)
    per_round = instances * cfg.batch_size
    for now, start in enumerate(range(0, len(requests), per_round), start=1):
        taken = _route_round(requests[start : start + per_round], fleet, chooser, cfg)
        for index, lookups in taken.items():
            for lookup in lookups:
                _apply(fleet[index], lookup, now, cfg.page_size)
    stores = {id(i.store): i.store for i in fleet}.values()
    return FleetRun(
        instances, router, shared, page_bytes(cfg.layer_num, cfg.page_size, cfg.draft),
        tuple(i.meters for i in fleet), sum(len(s.objects) // len(s.parts) for s in stores),
    )  # fmt: skip


__all__ = ["FleetRun", "InstanceMeters", "run_fleet"]
