"""scripts/gpu/bundle.py on a small synthetic bundle: no network, no real wheels."""

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]


def _bundle_module():
    spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "scripts" / "gpu" / "bundle.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bundle = _bundle_module()

KERNEL = "sglang_kernel-0.4.2.post2-cp310-abi3-manylinux2014_x86_64.whl"
WHEELS = {
    "sglang-0.5.12.post1-py3-none-any.whl": ["sglang/__init__.py"],
    "transformers-5.6.0-py3-none-any.whl": ["transformers/__init__.py"],
    "tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": ["tokenizers/__init__.py"],
    "apache_tvm_ffi-0.1.9-cp312-abi3-manylinux_2_28_x86_64.whl": ["tvm_ffi/__init__.py"],
    KERNEL: [
        "sgl_kernel/__init__.py",
        "sgl_kernel/sm90/common_ops.abi3.so",
        "sgl_kernel/flashmla_ops.abi3.so",
        "sgl_kernel/spatial_ops.abi3.so",
        "sgl_kernel/flash_ops.abi3.so",
        "sgl_kernel/sm90/flash_ops.abi3.so",
        "sgl_kernel/sm100/common_ops.abi3.so",
        "sgl_kernel/include/x.h",
        "lib/libmscclpp_static.a",  # 0.4.2.post2 puts these at the wheel root
        "_mscclpp.cpython-310-x86_64-linux-gnu.so",
        "triton_kernels/matmul_ogs.py",
    ],
}


def _make_wheel(path: Path, files, payload: bytes = b"x" * 64) -> None:
    dist_info = path.name.split("-")[0] + "-" + path.name.split("-")[1] + ".dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for name in files:
            zf.writestr(name, payload)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(f"{n},sha256=abc,64" for n in files) + "\n")


@pytest.fixture
def prepared(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, files in WHEELS.items():
        _make_wheel(wheels / name, files)
    bundle.trim_wheel(wheels / KERNEL, bundle.LINES["0.5.12.post1"])
    bundle.write_manifest(tmp_path)
    return tmp_path


def test_a_prepared_bundle_passes(prepared):
    assert bundle.check_bundle(prepared) == []
    assert bundle.main(["check", str(prepared)]) == 0


def test_trim_keeps_common_and_flashmla_ops_and_drops_the_rest(prepared):
    with zipfile.ZipFile(prepared / "wheels" / KERNEL) as zf:
        names = set(zf.namelist())
        record = zf.read("sglang_kernel-0.4.2.post2.dist-info/RECORD").decode()
        methods = {info.compress_type for info in zf.infolist()}
    assert methods == {zipfile.ZIP_DEFLATED}  # this line's wheels stay deflated
    assert {"sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so"} <= names
    for dropped in ("flash_ops", "sm100", "lib/", "include", "triton_kernels", "mscclpp"):
        assert not any(dropped in n for n in names), dropped
        assert dropped not in record


def test_a_tampered_or_unlisted_wheel_is_reported(prepared):
    victim = prepared / "wheels" / "sglang-0.5.12.post1-py3-none-any.whl"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    _make_wheel(prepared / "wheels" / "extra-1.0-py3-none-any.whl", ["extra/__init__.py"])
    problems = bundle.check_bundle(prepared)
    assert any("sha256 differs" in p for p in problems)
    assert any("extra-1.0" in p and "not in" in p for p in problems)


def test_size_limit_pins_platforms_and_host_packages_are_checked(prepared):
    assert any("over the" in p for p in bundle.check_bundle(prepared, size_limit=100))
    wheels = prepared / "wheels"
    (wheels / "sglang-0.5.12.post1-py3-none-any.whl").rename(wheels / "sglang-0.5.11-py3-none-any.whl")
    _make_wheel(wheels / "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", ["torch/__init__.py"])
    _make_wheel(wheels / "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl", ["numpy/__init__.py"])
    bundle.write_manifest(prepared)
    problems = bundle.check_bundle(prepared)
    assert any("sglang 0.5.11: expected ==0.5.12.post1" in p for p in problems)
    assert any("torch" in p and "must not be shadowed" in p for p in problems)
    assert any("numpy-2.4.6-cp311" in p and "cp312" in p for p in problems)


def test_an_untrimmed_kernel_or_a_missing_required_wheel_is_reported(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _make_wheel(wheels / KERNEL, ["sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/flash_ops.abi3.so"])
    bundle.write_manifest(tmp_path)
    problems = bundle.check_bundle(tmp_path)
    assert any("still contains" in p for p in problems)
    assert any("lacks flashmla_ops" in p for p in problems)
    assert any("missing wheel: transformers" in p for p in problems)


def test_no_manifest_is_a_clear_problem(tmp_path):
    assert bundle.check_bundle(tmp_path) == [f"{tmp_path}: no MANIFEST.sha256 (run prepare_bundle.sh)"]


def test_prepare_bundle_dry_run_downloads_nothing():
    import subprocess

    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "prepare_bundle.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=30, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "--no-deps --only-binary=:all: --python-version 3.12" in out.stdout
    assert "-r scripts/gpu/bundle-requirements.txt sglang-kernel==0.4.2.post2" in out.stdout
    assert "bundle.py trim --line 0.5.12.post1 .gpucheck/wheels/sglang_kernel-*.whl" in out.stdout
    assert "bundle.py check --line 0.5.12.post1 .gpucheck" in out.stdout
