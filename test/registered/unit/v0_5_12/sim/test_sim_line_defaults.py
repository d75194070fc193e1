"""The 0.5.12.post1 simulator's defaults are a default launch's: a setting left unset
resolves to what ``sglang.launch_server`` gives that flag when it is left off."""

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.lines import installed_line
from sglang_cp_hicache.testing.server_defaults import upstream_default


def test_the_unset_host_layout_is_upstreams_default() -> None:
    line = installed_line()
    assert line.release == "0.5.12.post1"
    assert line.resolved_mem_layout(SimConfig()) == upstream_default("hicache_mem_layout") == "layer_first"
    assert line.resolved_mem_layout(SimConfig(mem_layout="page_first")) == "page_first"
