"""The offline wheel bundle for the one-GPU check (``.gpucheck/``): trim, manifest, check.

Standard library only: it runs on the preparing machine and on the offline GPU host.

    python scripts/gpu/bundle.py trim-kernel WHEEL   # drop what the sm90 NSA path never loads
    python scripts/gpu/bundle.py manifest DIR        # write DIR/MANIFEST.sha256
    python scripts/gpu/bundle.py check DIR           # verify; prints problems, exit 1 if any

Bundle layout: ``DIR/wheels/*.whl`` and ``DIR/MANIFEST.sha256`` (``sha256  bytes  path``).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Sequence

MANIFEST = "MANIFEST.sha256"
SIZE_LIMIT_BYTES = 60 * 1024 * 1024
KERNEL_DIST = "sglang_kernel"
KERNEL_KEEP = ("common_ops", "flashmla_ops")  # basenames (any extension) that must stay
# What the sm90 NSA path does not load from the sglang-kernel wheel: these directories
# (at the wheel root or inside the package) and these file names.
KERNEL_DROP_DIRS = ("sm100", "lib", "include", "triton_kernels")
KERNEL_DROP_FILES = ("flash_ops*", "*mscclpp*")
PINNED = {
    "sglang": "0.5.12.post1",
    "sglang_kernel": "0.4.2.post2",
    "transformers": "5.6.0",
}
REQUIRED = (*PINNED, "tokenizers", "apache_tvm_ffi")
FORBIDDEN = ("torch", "triton", "nvidia_*", "cuda_*")  # the host's own; never shadowed
_WHEEL_NAME = re.compile(
    r"^(?P<dist>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


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


def is_dropped_kernel_path(name: str) -> bool:
    *dirs, base = name.split("/")
    if any(d.endswith(".dist-info") for d in dirs):
        return False
    return any(d in KERNEL_DROP_DIRS for d in dirs) or any(fnmatch.fnmatch(base, p) for p in KERNEL_DROP_FILES)


def trim_kernel_wheel(wheel: Path) -> Dict[str, int]:
    """Rewrite ``wheel`` in place without the dropped paths (RECORD updated to match)."""
    kept = dropped = 0
    fd, tmp_name = tempfile.mkstemp(suffix=".whl.part", dir=wheel.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp_name, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if is_dropped_kernel_path(info.filename):
                    dropped += 1
                    continue
                data = src.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    data = ("\n".join(l for l in lines if not is_dropped_kernel_path(l.split(",", 1)[0])) + "\n").encode()
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
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


def check_bundle(bundle: Path, size_limit: int = SIZE_LIMIT_BYTES, verify_hashes: bool = True) -> List[str]:
    """Every problem with ``bundle`` (empty when it is good to carry to the GPU host)."""
    problems: List[str] = []
    if not (bundle / MANIFEST).is_file():
        return [f"{bundle}: no {MANIFEST} (run prepare_bundle.sh)"]
    entries = _read_manifest(bundle)
    on_disk = {f"wheels/{w.name}": w for w in wheels_of(bundle)}
    for rel in sorted(set(on_disk) - set(entries)):
        problems.append(f"{rel}: not in {MANIFEST}")
    for rel, (digest, size) in sorted(entries.items()):
        path = bundle / rel
        if not path.is_file():
            problems.append(f"{rel}: listed but missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {size}")
        elif verify_hashes and sha256_of(path) != digest:
            problems.append(f"{rel}: sha256 differs from {MANIFEST}")
    total = sum(p.stat().st_size for p in on_disk.values())
    if total > size_limit:
        problems.append(f"bundle is {total / 2**20:.1f} MiB, over the {size_limit / 2**20:.0f} MiB that can travel")
    names = {}
    for rel in on_disk:
        try:
            names[rel] = WheelName.parse(Path(rel).name)
        except ValueError as exc:
            problems.append(str(exc))
    dists = {n.dist: n for n in names.values()}
    for dist in REQUIRED:
        if dist not in dists:
            problems.append(f"missing wheel: {dist}")
    for dist, version in PINNED.items():
        if dist in dists and dists[dist].version != version:
            problems.append(f"{dist} {dists[dist].version}: expected =={version}")
    for rel, name in names.items():
        if not name.installs_on_cp312_x86_64():
            problems.append(f"{rel}: not a cp312 manylinux x86_64 (or pure-Python) wheel")
        if any(fnmatch.fnmatch(name.dist, pattern) for pattern in FORBIDDEN):
            problems.append(f"{rel}: the GPU host's own {name.dist} must not be shadowed")
    kernel = [bundle / rel for rel, n in names.items() if n.dist == KERNEL_DIST]
    for wheel in kernel:
        problems.extend(_kernel_problems(wheel))
    return problems


def _kernel_problems(wheel: Path) -> List[str]:
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
    problems = [f"{wheel.name}: still contains {name} (run trim-kernel)" for name in files if is_dropped_kernel_path(name)][:3]
    basenames = {Path(f).name.split(".", 1)[0] for f in files}
    problems += [f"{wheel.name}: lacks {keep} (the sm90 NSA path loads it)" for keep in KERNEL_KEEP if keep not in basenames]
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("trim-kernel").add_argument("wheel", type=Path)
    sub.add_parser("manifest").add_argument("bundle", type=Path)
    sub.add_parser("check").add_argument("bundle", type=Path)
    args = parser.parse_args(argv)
    if args.command == "trim-kernel":
        print(f"trimmed {args.wheel.name}: {trim_kernel_wheel(args.wheel)}")
        return 0
    if args.command == "manifest":
        path = write_manifest(args.bundle)
        total = sum(w.stat().st_size for w in wheels_of(args.bundle))
        print(f"{path}: {len(wheels_of(args.bundle))} wheels, {total / 2**20:.1f} MiB")
        return 0
    problems = check_bundle(args.bundle)
    for problem in problems:
        print(f"bundle: {problem}", file=sys.stderr)
    if not problems:
        total = sum(w.stat().st_size for w in wheels_of(args.bundle))
        print(f"bundle ok: {len(wheels_of(args.bundle))} wheels, {total / 2**20:.1f} MiB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
