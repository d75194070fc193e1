"""Which line serves which SGLang release: ``core.releases`` maps both supported releases,
refuses every other version naming the supported ones, ``plugin.register`` raises that
refusal before registering anything, and the line chosen is the installed sglang's.

Runs in both venvs (0.5.12.post1 and 0.5.23).
"""

from importlib import metadata

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_cp_hicache import plugin
from sglang_cp_hicache.core import releases

SUPPORTED = {"0.5.23": "sglang_cp_hicache.v0_5_23", "0.5.12.post1": "sglang_cp_hicache.v0_5_12"}


@pytest.mark.parametrize("release, package", sorted(SUPPORTED.items()))
def test_each_supported_release_maps_to_its_line(release, package):
    assert releases.line_package(release) == package


@pytest.mark.parametrize("version", ["0.5.22", "0.5.12", "0.5.24", "0.5.23.post1", "0.6.0"])
def test_any_other_version_is_refused_naming_the_supported_ones(version):
    with pytest.raises(releases.UnsupportedSGLangRelease) as excinfo:
        releases.line_package(version)
    message = str(excinfo.value)
    assert f"does not support sglang=={version};" in message
    assert "supported releases: sglang==0.5.23, sglang==0.5.12.post1" in message


def test_no_installed_sglang_is_refused_naming_the_supported_ones(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(releases.metadata, "version", not_installed)
    with pytest.raises(releases.UnsupportedSGLangRelease, match="no sglang is installed.*sglang==0.5.23"):
        releases.line_package()


def test_plugin_register_refuses_an_unsupported_installed_release(monkeypatch):
    monkeypatch.setattr(releases, "installed_release", lambda: "0.5.22")
    registered = {target: list(entries) for target, entries in HookRegistry._hooks.items()}
    with pytest.raises(releases.UnsupportedSGLangRelease) as excinfo:
        plugin.register()
    assert "sglang==0.5.22" in str(excinfo.value) and "sglang==0.5.12.post1" in str(excinfo.value)
    assert {t: list(e) for t, e in HookRegistry._hooks.items()} == registered  # nothing handed over


def test_the_line_chosen_is_the_installed_sglang():
    installed = metadata.version("sglang")
    assert installed in SUPPORTED
    hooks = plugin.line_hooks()
    assert hooks.__name__ == f"{SUPPORTED[installed]}.hooks"
    assert hooks.RELEASE == installed
