"""The offline wheel bundle for the one-GPU check, per SGLang line: trim, manifest, check.

Standard library only: it runs on the preparing machine and on the offline GPU host.

    python scripts/gpu/bundle.py trim --line L WHEEL   # drop what the line's sm90 path never loads
    python scripts/gpu/bundle.py manifest DIR          # write DIR/MANIFEST.sha256
    python scripts/gpu/bundle.py check --line L DIR    # verify; prints problems, exit 1 if any
    python scripts/gpu/bundle.py describe --line L     # "BUNDLE_DIR REQUIREMENTS KERNEL_PIN"

Bundle layout: ``DIR/wheels/*.whl`` and ``DIR/MANIFEST.sha256`` (``sha256  bytes  path``).
``--line`` defaults to 0.5.12.post1 (bundle ``.gpucheck``); 0.5.23's is ``.gpucheck-0.5.23``.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import re
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

MANIFEST = "MANIFEST.sha256"
SIZE_LIMIT_BYTES = 60 * 1024 * 1024
KERNEL_DIST = "sglang_kernel"
FORBIDDEN = ("torch", "triton", "nvidia_*", "cuda_*")  # the host's own; never shadowed
LZMA_MIN_BYTES = 64 * 1024  # smaller members stay deflated (LZMA's header costs more there)
_WHEEL_NAME = re.compile(
    r"^(?P<dist>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


@dataclass(frozen=True)
class DropRule:
    """Paths of one distribution's wheel that its line's check never loads.

    A path is dropped when a directory component is in ``dirs``, its base name matches a
    glob of ``files``, it starts with one of ``prefixes``, or it lies in a sub-directory of
    ``keep_only[0]`` not named in ``keep_only[1]``. ``*.dist-info`` paths always stay.
    ``keep``: base names (without extension) that must survive the trim.
    """

    dirs: Tuple[str, ...] = ()
    files: Tuple[str, ...] = ()
    prefixes: Tuple[str, ...] = ()
    keep_only: Optional[Tuple[str, Tuple[str, ...]]] = None
    keep: Tuple[str, ...] = ()

    def drops(self, name: str) -> bool:
        *dirs, base = name.split("/")
        if any(d.endswith(".dist-info") for d in dirs):
            return False
        if any(d in self.dirs for d in dirs) or any(fnmatch.fnmatch(base, p) for p in self.files):
            return True
        if any(name.startswith(p) for p in self.prefixes):
            return True
        if self.keep_only is not None:
            prefix, names = self.keep_only
            rest = name[len(prefix):].split("/") if name.startswith(prefix) else []
            return len(rest) > 1 and rest[0] not in names
        return False


@dataclass(frozen=True)
class LineSpec:
    """One SGLang line's bundle: where it lives, what it pins and how its wheels are trimmed.

    Invariant: every pinned distribution is required; ``lzma`` lines recompress members of
    at least :data:`LZMA_MIN_BYTES` with LZMA (pip reads any method Python's zipfile reads).
    """

    bundle_dir: str
    requirements: str  # file name under scripts/gpu
    pinned: Mapping[str, str]
    required: Tuple[str, ...]
    drops: Mapping[str, DropRule] = field(default_factory=dict)
    lzma: bool = False

    def __post_init__(self) -> None:
        unrequired = sorted(set(self.pinned) - set(self.required))
        if unrequired:
            raise ValueError(f"pinned but not required: {unrequired}")

    @property
    def kernel_pin(self) -> str:
        return f"sglang-kernel=={self.pinned[KERNEL_DIST]}"


#: The sm90 NSA path of 0.5.12.post1 loads sm90/common_ops and flashmla_ops.
KERNEL_DROP_0_5_12 = DropRule(
    dirs=("sm100", "lib", "include", "triton_kernels"),
    files=("flash_ops*", "*mscclpp*"),
    keep=("common_ops", "flashmla_ops"),
)
#: 0.5.23 takes FlashMLA from sgl-flash-mla; of sglang-kernel its sm90 path loads
#: sm90/common_ops only (flashmla_ops, infllm_ops and spatial_ops load on first use by
#: paths the check does not take: sgl_kernel.flash_mla, infllm_v2, PDMux).
KERNEL_DROP_0_5_23 = DropRule(
    dirs=("sm100", "lib", "include", "triton_kernels"),
    files=("flash_ops*", "flashmla_ops*", "infllm_ops*", "spatial_ops*", "*mscclpp*"),
    keep=("common_ops",),
)
#: The transformers model packages sglang 0.5.23 imports (its config registry at import
#: time; recorded in docs/gpu_checks.md): every other ``transformers/models/<name>/`` goes.
TRANSFORMERS_MODELS_0_5_23 = (
    "auto", "deepseek_v3", "encoder_decoder", "falcon_mamba", "gemma", "gemma4", "glm_moe_dsa",
    "glm_ocr", "gpt2", "gpt_oss", "lfm2", "lfm2_moe", "lfm2_vl", "llama", "mamba", "mamba2",
    "mellum", "qwen2", "qwen2_5_vl", "qwen3", "qwen3_5", "qwen3_moe", "siglip", "t5", "whisper",
)  # fmt: skip

LINES: Dict[str, LineSpec] = {
    "0.5.12.post1": LineSpec(
        bundle_dir=".gpucheck",
        requirements="bundle-requirements.txt",
        pinned={"sglang": "0.5.12.post1", KERNEL_DIST: "0.4.2.post2", "transformers": "5.6.0"},
        required=("sglang", KERNEL_DIST, "transformers", "tokenizers", "apache_tvm_ffi"),
        drops={KERNEL_DIST: KERNEL_DROP_0_5_12},
    ),
    "0.5.23": LineSpec(
        bundle_dir=".gpucheck-0.5.23",
        requirements="bundle-requirements-0.5.23.txt",
        pinned={
            "sglang": "0.5.23", KERNEL_DIST: "0.4.6", "sgl_flash_mla": "1.0.0",
            "torchvision": "0.26.0", "transformers": "5.19.0", "apache_tvm_ffi": "0.1.11",
        },  # fmt: skip
        required=("sglang", KERNEL_DIST, "sgl_flash_mla", "torchvision", "transformers", "tokenizers", "apache_tvm_ffi"),
        drops={
            KERNEL_DIST: KERNEL_DROP_0_5_23,
            # The Rust extensions load on demand (load_rust_extension; the plugin runs the
            # python radix tree); multimodal_gen is the diffusion runtime.
            "sglang": DropRule(files=("*.so",), prefixes=("sglang/multimodal_gen/",), keep=("page_interleave_pool",)),
            "transformers": DropRule(keep_only=("transformers/models/", TRANSFORMERS_MODELS_0_5_23), keep=("configuration_glm_moe_dsa",)),
            # _C (its ops back torchvision's fake registrations) needs the host's libcudart;
            # image.so and the libraries vendored for it decode images on demand only.
            "torchvision": DropRule(files=("image.so",), prefixes=("torchvision.libs/",), keep=("_C",)),
            # PIL's core and its font module stay; AVIF, WebP, colour management and Tk
            # load on first use of those formats.
            "pillow": DropRule(
                files=("_avif.*", "_webp.*", "_imagingcms.*", "_imagingtk.*", "libavif-*", "libwebp*",
                       "libsharpyuv-*", "liblcms2-*"),
                keep=("_imaging", "_imagingft"),
            ),  # fmt: skip
        },
        lzma=True,
    ),
}
DEFAULT_LINE = "0.5.12.post1"


@dataclass(frozen=True)
class WheelName:
    dist: str  # normalised: lower case, runs of -_. as _
    version: str
    python_tag: str
    abi_tag: str
    platform_tag: str

    @classmethod
    def parse(cls, filename: str) -> "WheelName":
        match = _WHEEL_NAME.match(filename)
        if not match:
            raise ValueError(f"not a wheel file name: {filename}")
        dist = re.sub(r"[-_.]+", "_", match["dist"]).lower()
        return cls(dist, match["version"], match["py"], match["abi"], match["plat"])

    def installs_on_cp312_x86_64(self) -> bool:
        pythons = self.python_tag.split(".")
        python_ok = any(p in ("py3", "cp312") or (p.startswith("cp3") and self.abi_tag == "abi3") for p in pythons)
        platforms = self.platform_tag.split(".")
        platform_ok = any(p == "any" or (p.startswith("manylinux") and p.endswith("x86_64")) for p in platforms)
        return python_ok and platform_ok


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _member_compression(info: zipfile.ZipInfo, lzma: bool) -> int:
    return zipfile.ZIP_LZMA if lzma and info.file_size >= LZMA_MIN_BYTES else zipfile.ZIP_DEFLATED


def trim_wheel(wheel: Path, spec: LineSpec) -> Dict[str, int]:
    """Rewrite ``wheel`` in place without the paths its line drops (RECORD updated to match),
    LZMA-compressing its larger members on ``lzma`` lines. Kept files are byte-identical, so
    their RECORD hashes stay valid."""
    rule = spec.drops.get(WheelName.parse(wheel.name).dist, DropRule())
    kept = dropped = 0
    fd, tmp_name = tempfile.mkstemp(suffix=".whl.part", dir=wheel.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp_name, "w") as dst:
            for info in src.infolist():
                if rule.drops(info.filename):
                    dropped += 1
                    continue
                data = src.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    data = ("\n".join(l for l in lines if not rule.drops(l.split(",", 1)[0])) + "\n").encode()
                dst.writestr(info, data, compress_type=_member_compression(info, spec.lzma))
                kept += 1
        os.replace(tmp_name, wheel)
    finally:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)
    return {"kept": kept, "dropped": dropped, "bytes": wheel.stat().st_size}


def wheels_of(bundle: Path) -> List[Path]:
    return sorted((bundle / "wheels").glob("*.whl"))


def write_manifest(bundle: Path) -> Path:
    lines = [f"{sha256_of(w)}  {w.stat().st_size}  wheels/{w.name}" for w in wheels_of(bundle)]
    path = bundle / MANIFEST
    path.write_text("\n".join(lines) + "\n")
    return path


def _read_manifest(bundle: Path) -> Dict[str, tuple]:
    entries = {}
    for line in (bundle / MANIFEST).read_text().splitlines():
        if line.strip():
            digest, size, rel = line.split(None, 2)
            entries[rel] = (digest, int(size))
    return entries


def _manifest_problems(bundle: Path, verify_hashes: bool) -> List[str]:
    problems = []
    entries = _read_manifest(bundle)
    on_disk = {f"wheels/{w.name}" for w in wheels_of(bundle)}
    problems += [f"{rel}: not in {MANIFEST}" for rel in sorted(on_disk - set(entries))]
    for rel, (digest, size) in sorted(entries.items()):
        path = bundle / rel
        if not path.is_file():
            problems.append(f"{rel}: listed but missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {size}")
        elif verify_hashes and sha256_of(path) != digest:
            problems.append(f"{rel}: sha256 differs from {MANIFEST}")
    return problems


def check_bundle(
    bundle: Path, size_limit: int = SIZE_LIMIT_BYTES, verify_hashes: bool = True, line: str = DEFAULT_LINE
) -> List[str]:
    """Every problem with ``bundle`` as ``line``'s (empty when it is good to carry)."""
    if not (bundle / MANIFEST).is_file():
        return [f"{bundle}: no {MANIFEST} (run prepare_bundle.sh)"]
    spec = LINES[line]
    problems = _manifest_problems(bundle, verify_hashes)
    wheels = wheels_of(bundle)
    total = sum(w.stat().st_size for w in wheels)
    if total > size_limit:
        problems.append(f"bundle is {total / 2**20:.1f} MiB, over the {size_limit / 2**20:.0f} MiB that can travel")
    names = {}
    for wheel in wheels:
        try:
            names[wheel] = WheelName.parse(wheel.name)
        except ValueError as exc:
            problems.append(str(exc))
    dists = {n.dist: n for n in names.values()}
    problems += [f"missing wheel: {dist}" for dist in spec.required if dist not in dists]
    for dist, version in spec.pinned.items():
        if dist in dists and dists[dist].version != version:
            problems.append(f"{dist} {dists[dist].version}: expected =={version}")
    for wheel, name in names.items():
        rel = f"wheels/{wheel.name}"
        if not name.installs_on_cp312_x86_64():
            problems.append(f"{rel}: not a cp312 manylinux x86_64 (or pure-Python) wheel")
        if any(fnmatch.fnmatch(name.dist, pattern) for pattern in FORBIDDEN):
            problems.append(f"{rel}: the GPU host's own {name.dist} must not be shadowed")
        if name.dist in spec.drops:
            problems.extend(_trim_problems(wheel, spec.drops[name.dist]))
    if spec.lzma and not _has_lzma():
        problems.append("this Python has no lzma module: pip cannot unpack this line's LZMA-compressed wheels")
    return problems


def _has_lzma() -> bool:
    try:
        import lzma  # noqa: F401
    except ImportError:
        return False
    return True


def _trim_problems(wheel: Path, rule: DropRule) -> List[str]:
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
    problems = [f"{wheel.name}: still contains {name} (run trim)" for name in files if rule.drops(name)][:3]
    basenames = {Path(f).name.split(".", 1)[0] for f in files}
    problems += [f"{wheel.name}: lacks {keep} (the check loads it)" for keep in rule.keep if keep not in basenames]
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("manifest").add_argument("bundle", type=Path)
    for command, target in (("trim", "wheel"), ("check", "bundle"), ("describe", None)):
        cmd = sub.add_parser(command)
        cmd.add_argument("--line", choices=sorted(LINES), default=DEFAULT_LINE)
        if target:
            cmd.add_argument(target, type=Path)
    args = parser.parse_args(argv)
    if args.command == "describe":
        spec = LINES[args.line]
        print(spec.bundle_dir, spec.requirements, spec.kernel_pin)
        return 0
    if args.command == "trim":
        print(f"trimmed {args.wheel.name}: {trim_wheel(args.wheel, LINES[args.line])}")
        return 0
    if args.command == "manifest":
        path = write_manifest(args.bundle)
        total = sum(w.stat().st_size for w in wheels_of(args.bundle))
        print(f"{path}: {len(wheels_of(args.bundle))} wheels, {total / 2**20:.1f} MiB")
        return 0
    problems = check_bundle(args.bundle, line=args.line)
    for problem in problems:
        print(f"bundle: {problem}", file=sys.stderr)
    if not problems:
        total = sum(w.stat().st_size for w in wheels_of(args.bundle))
        print(f"bundle ok ({args.line}): {len(wheels_of(args.bundle))} wheels, {total / 2**20:.1f} MiB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
