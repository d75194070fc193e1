"""scripts/gpu/bundle.py's 0.5.23 line on small synthetic wheels: no network, no real wheels.

The line trims sglang-kernel to sm90/common_ops (FlashMLA is sgl-flash-mla's now), sglang,
transformers, torchvision and pillow to what the check imports, and LZMA-compresses every
wheel's larger members; the 0.5.12.post1 line is unchanged (``v0_5_12/scripts/test_gpu_bundle.py``).
"""

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_cp_hicache.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[5]
LINE = "0.5.23"


bundle = load_script("scripts/gpu/bundle.py", "gpu_bundle")
SPEC = bundle.LINES[LINE]
BIG = 2 * bundle.LZMA_MIN_BYTES  # members at least this big are recompressed

GLM_CONFIG = "transformers/models/glm_moe_dsa/configuration_glm_moe_dsa.py"
KERNEL = "sglang_kernel-0.4.6-cp310-abi3-manylinux2014_x86_64.whl"
SGLANG = "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
TRANSFORMERS = "transformers-5.19.0-py3-none-any.whl"
TORCHVISION = "torchvision-0.26.0-cp312-cp312-manylinux_2_28_x86_64.whl"
PILLOW = "pillow-13.0.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
WHEELS = {
    KERNEL: [
        "sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so",
        "sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so",
        "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so", "sgl_kernel/infllm_v2/_loader.py",
        "triton_kernels/topk.py",
    ],
    SGLANG: [
        "sglang/__init__.py", "sglang/srt/mem_cache/page_interleave_pool.py",
        "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so",
        "sglang/srt/rust_extensions/__init__.py", "sglang/multimodal_gen/runtime/x.py",
        "sglang/kernels/jit/csrc/topk.cuh",
    ],
    TRANSFORMERS: [
        "transformers/__init__.py", "transformers/models/__init__.py",
        GLM_CONFIG, "transformers/models/auto/configuration_auto.py", "transformers/models/bert/modeling_bert.py",
    ],
    TORCHVISION: [
        "torchvision/__init__.py", "torchvision/_C.so", "torchvision/image.so",
        "torchvision.libs/libnvjpeg.36e11081.so.13",
    ],
    PILLOW: [
        "PIL/Image.py", "PIL/_imaging.cpython-312-x86_64-linux-gnu.so",
        "PIL/_imagingft.cpython-312-x86_64-linux-gnu.so", "PIL/_avif.cpython-312-x86_64-linux-gnu.so",
        "PIL/_webp.cpython-312-x86_64-linux-gnu.so", "pillow.libs/libavif-c6062d5f.so.16.4.2",
        "pillow.libs/libtiff-20b7e810.so.6.3.0",
    ],
    "sgl_flash_mla-1.0.0-cp310-abi3-manylinux2014_x86_64.whl": ["flash_mla/__init__.py", "flash_mla/_C_legacy.abi3.so"],
    "tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": ["tokenizers/__init__.py"],
    "apache_tvm_ffi-0.1.11-cp312-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl": ["tvm_ffi/__init__.py"],
}  # fmt: skip
DROPPED = {
    KERNEL: ("flashmla_ops", "flash_ops", "sm100", "spatial_ops", "infllm_ops", "triton_kernels"),
    SGLANG: ("rust_extensions/_server", "multimodal_gen"),
    TRANSFORMERS: ("models/bert",),
    TORCHVISION: ("image.so", "torchvision.libs"),
    PILLOW: ("_avif", "_webp", "libavif"),
}
KEPT = {
    KERNEL: ("sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/infllm_v2/_loader.py"),
    SGLANG: ("sglang/srt/rust_extensions/__init__.py", "sglang/kernels/jit/csrc/topk.cuh"),
    TRANSFORMERS: ("transformers/models/__init__.py", GLM_CONFIG),
    TORCHVISION: ("torchvision/_C.so",),
    PILLOW: ("PIL/_imaging.cpython-312-x86_64-linux-gnu.so", "PIL/_imagingft.cpython-312-x86_64-linux-gnu.so",
             "pillow.libs/libtiff-20b7e810.so.6.3.0"),
}  # fmt: skip


def _payload(name: str) -> bytes:
    """Big, compressible members for shared objects and the GLM config (LZMA applies),
    small ones otherwise."""
    big = ".so" in name or name == GLM_CONFIG
    return (name.encode() * (BIG // len(name) + 1))[:BIG] if big else name.encode()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _make_wheel(path: Path, files) -> None:
    dist, version = path.name.split("-")[:2]
    dist_info = f"{dist}-{version}.dist-info"
    meta = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in files:
            zf.writestr(name, _payload(name))
        for name, data in meta.items():
            zf.writestr(name, data)
        lines = [_record_line(n, _payload(n)) for n in files] + [_record_line(n, d) for n, d in meta.items()]
        zf.writestr(f"{dist_info}/RECORD", "\n".join(lines + [f"{dist_info}/RECORD,,"]) + "\n")


@pytest.fixture
def prepared(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, files in WHEELS.items():
        _make_wheel(wheels / name, files)
        bundle.trim_wheel(wheels / name, SPEC)
    bundle.write_manifest(tmp_path)
    return tmp_path


def test_a_prepared_bundle_passes_as_0_5_23_and_not_as_0_5_12(prepared):
    assert bundle.check_bundle(prepared, line=LINE) == []
    assert bundle.main(["check", "--line", LINE, str(prepared)]) == 0
    as_old_line = bundle.check_bundle(prepared)  # the default line pins other versions
    assert any("sglang 0.5.23: expected ==0.5.12.post1" in p for p in as_old_line)
    assert any("lacks flashmla_ops" in p for p in as_old_line)


@pytest.mark.parametrize("wheel", sorted(DROPPED))
def test_trim_drops_what_the_check_never_loads_and_keeps_the_rest(prepared, wheel):
    with zipfile.ZipFile(prepared / "wheels" / wheel) as zf:
        names = set(zf.namelist())
        record = zf.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    for dropped in DROPPED[wheel]:
        assert not any(dropped in n for n in names), dropped
        assert dropped not in record, dropped
    for kept in KEPT[wheel]:
        assert kept in names and kept in record, kept


def test_larger_members_are_lzma_and_unchanged_so_record_hashes_hold(prepared):
    """pip verifies each file against RECORD while installing: the recompressed bytes must
    be the downloaded ones."""
    for wheel in (prepared / "wheels").glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            record = zf.read(next(n for n in zf.namelist() if n.endswith("RECORD"))).decode().splitlines()
            for line in record:
                name = line.split(",", 1)[0]
                if not name.endswith("RECORD"):
                    assert _record_line(name, zf.read(name)) == line, (wheel.name, name)
            for info in zf.infolist():
                expected = zipfile.ZIP_LZMA if info.file_size >= bundle.LZMA_MIN_BYTES else zipfile.ZIP_DEFLATED
                assert info.compress_type == expected, (wheel.name, info.filename)


def test_pip_installs_the_lzma_wheels_offline(prepared, tmp_path):
    site = tmp_path / "site"
    wheels = sorted(str(w) for w in (prepared / "wheels").glob("*.whl") if "py3-none-any" in w.name)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site), *wheels],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    with zipfile.ZipFile(prepared / "wheels" / TRANSFORMERS) as zf:
        assert zf.getinfo(GLM_CONFIG).compress_type == zipfile.ZIP_LZMA
    assert (site / GLM_CONFIG).read_bytes() == _payload(GLM_CONFIG)
    assert not (site / "transformers" / "models" / "bert").exists()


def test_untrimmed_wheels_pins_and_the_flash_mla_wheel_are_checked(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, files in WHEELS.items():
        if not name.startswith("sgl_flash_mla"):
            _make_wheel(wheels / name, files)  # not trimmed
    _make_wheel(wheels / "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", ["torch/__init__.py"])
    (wheels / KERNEL).rename(wheels / KERNEL.replace("0.4.6", "0.4.10"))
    bundle.write_manifest(tmp_path)
    problems = bundle.check_bundle(tmp_path, line=LINE)
    assert "missing wheel: sgl_flash_mla" in problems
    assert any("sglang_kernel 0.4.10: expected ==0.4.6" in p for p in problems)
    assert any("torch" in p and "must not be shadowed" in p for p in problems)
    for wheel in (SGLANG, TRANSFORMERS, TORCHVISION, PILLOW):
        assert any(p.startswith(f"{wheel}: still contains") for p in problems), wheel


def test_prepare_bundle_0_5_23_dry_run_names_its_folder_list_and_kernel():
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    script = str(ROOT / "scripts" / "gpu" / "prepare_bundle.sh")
    out = subprocess.run(["bash", script, "--sglang", LINE, "--dry-run"], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    assert "--dest .gpucheck-0.5.23/wheels -r scripts/gpu/bundle-requirements-0.5.23.txt sglang-kernel==0.4.6" in out.stdout
    assert "bundle.py trim --line 0.5.23" in out.stdout and "bundle.py check --line 0.5.23 .gpucheck-0.5.23" in out.stdout
    refused = subprocess.run(["bash", script, "--sglang", "0.5.99", "--dry-run"], capture_output=True, text=True, timeout=30, env=env)
    assert refused.returncode == 2 and "usage" in refused.stderr


def test_the_requirements_pin_what_the_line_pins():
    lines = (ROOT / "scripts" / "gpu" / SPEC.requirements).read_text().splitlines()
    pins = dict(l.split("==") for l in lines if l and not l.startswith("#"))
    normalised = {name.replace("-", "_").lower(): version for name, version in pins.items()}
    for dist, version in SPEC.pinned.items():
        if dist != bundle.KERNEL_DIST:  # prepare_bundle.sh adds the kernel (LineSpec.kernel_pin)
            assert normalised.get(dist) == version, dist
    assert SPEC.kernel_pin == "sglang-kernel==0.4.6" and "sglang_kernel" not in normalised
