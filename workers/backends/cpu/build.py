"""The one loader of the CPU backend's C++ kernels (``csrc/``), and the registry of their self-checks.

**Building.** ``load(family, **params)`` compiles ``csrc/<family>.cpp`` through
``torch.utils.cpp_extension.load`` (ninja) into a Python module and imports it; each ``params``
item is a compile-time constant, the macro ``PD_<NAME>`` (``load("paged", block_size=16, ...)``:
``-DPD_BLOCK_SIZE=16``). A module's name holds its family, its parameters and a hash of what
went into it (the source and the ``csrc`` headers it includes, the flags, torch's and Python's
versions, this CPU's model and flags), so
each specialisation builds once per machine and is reused by every later process (a warm load is
~20 ms: ninja finds nothing to do). The modules live in one directory, ``cache_dir()``:
``$PDSERVE_KERNEL_CACHE``, else ``$PDSERVE_CACHE/kernels``, else ``~/.cache/pdserve/kernels``.
A build logs one INFO line (what, and how long it took); a load from the cache, one DEBUG line.
``PDSERVE_KERNEL_VERBOSE=1`` shows the compiler's commands and output (its warnings: the kernels
build with ``-Wall -Wextra`` and none is expected).

**Flags** (``kernel_flags``): the ones inductor's C++ toolchain gave these kernels when they
were built through it (torch 2.13, read from its compile commands), so that they compute the
same bits: ``-O3``, IEEE arithmetic (``-ffast-math``'s pieces, each turned back off, as inductor
writes them), no floating-point contraction (``-ffp-contract=off``: a fused multiply-add only
where a kernel asks for one), ``-march=native``, OpenMP, and the vector ISA that torch runs at
(``torch.backends.cpu.get_cpu_capability()``, which follows ``ATEN_CPU_CAPABILITY``: the
``CPU_CAPABILITY_*`` macro that selects ``at::vec``'s implementation, and its ``-m`` flags, as
inductor's ``pick_vec_isa`` chose them). The kernels' outputs were compared with the inductor
builds' bit for bit (AVX2; every kernel, both thread counts, each vector width the tests build).

**Calling.** A module's ``kernel`` is the C++ function, called with its arguments in order:
a tensor for each pointer, an int for each ``int64_t``, a float for each ``float``
(``csrc/binding.h``: plain CPython, ``METH_FASTCALL``). A tensor's data pointer is read through
``csrc/tensor_data.cpp``, the one module built against torch's Python headers (a slow compile,
once per torch version): a few ns an argument; without it (it did not build) a kernel reads
``Tensor.data_ptr()`` instead, correct but slower (logged once).

**Self-checks.** Each kernel family registers how to build it and how to compare it with aten
(``register``); ``usable(name, *key)`` builds it and runs the check, and where either fails logs
one WARNING line (what failed, and what runs instead) and says False: the caller keeps aten's
path. The families' ``*_usable``/``available`` functions ask it once per process.

``python -m workers.backends.cpu.build`` builds and checks every registered kernel (the shapes a
family lists as ``warm``): a cache warmed before the engine starts.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
PCH_HEADER = "pdserve_prelude.h"  # the larger kernels' common headers, precompiled once (_precompiled_dir)
MACRO_PREFIX = "PD_"

# What inductor's toolchain compiled these kernels with (torch 2.13 on x86-64 Linux, GCC 12: its
# compile commands), in its order: optimisation, -ffast-math's pieces turned back off as inductor
# writes them (IEEE arithmetic), no contraction, errno-setting libm, the host's ISA. The order
# matters: the later flag wins.
OPT_FLAGS = ["-O3", "-DNDEBUG", "-fno-omit-frame-pointer", "-g1"]
MATH_FLAGS = [
    "-fno-trapping-math",
    "-funsafe-math-optimizations",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-fno-finite-math-only",
    "-fno-unsafe-math-optimizations",
    "-fmath-errno",
    "-ffp-contract=off",
]
GCC_FLAGS = ["-fexcess-precision=fast", "-fno-tree-loop-vectorize"]
WARNING_FLAGS = ["-Wall", "-Wextra", "-Winvalid-pch"]
# inductor's, for at::vec and c10 used header-only (TORCH_CHECK throws std::runtime_error, no cmake_macros.h)
HEADER_ONLY_DEFINES = ["-DSTANDALONE_TORCH_HEADER", "-DC10_USING_CUSTOM_GENERATED_MACROS"]
# torch's CPU capability -> (the at::vec macro, the ISA flags inductor adds for it on x86-64)
ISA_FLAGS = {
    "AVX512": ("CPU_CAPABILITY_AVX512", ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]),
    "AVX2": ("CPU_CAPABILITY_AVX2", ["-mavx2", "-mfma", "-mf16c"]),
}

STALE_LOCK_S = 600  # a build's lock file older than this was left by a build that died
_lock = threading.RLock()


def cache_dir() -> Path:
    """Where the built modules live (one subdirectory each)."""
    if os.environ.get("PDSERVE_KERNEL_CACHE"):
        return Path(os.environ["PDSERVE_KERNEL_CACHE"]).expanduser()
    root = os.environ.get("PDSERVE_CACHE") or "~/.cache/pdserve"
    return Path(root).expanduser() / "kernels"


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def isa_flags() -> tuple[str, ...]:
    """The vector ISA's macro and flags: torch's CPU capability's (``ISA_FLAGS``), none elsewhere."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not _is_x86() or capability not in ISA_FLAGS:
        return ()
    macro, flags = ISA_FLAGS[capability]
    return (f"-D{macro}", *flags)


@functools.cache
def _compiler_is_clang() -> bool:
    from torch.utils.cpp_extension import get_cxx_compiler

    return "clang" in os.path.basename(get_cxx_compiler())


@functools.cache
def kernel_flags() -> tuple[str, ...]:
    """Every kernel's compiler flags (module docstring)."""
    gcc = [] if _compiler_is_clang() else GCC_FLAGS
    arch = ["-march=native"] if _is_x86() or platform.machine().lower() == "aarch64" else []
    return (
        *HEADER_ONLY_DEFINES,
        *OPT_FLAGS,
        *MATH_FLAGS,
        *gcc,
        *arch,
        "-fopenmp",
        *WARNING_FLAGS,
        *isa_flags(),
    )


def kernel_ldflags() -> tuple[str, ...]:
    """The OpenMP runtime inductor links: GCC's libgomp (clang's libomp)."""
    return ("-lomp",) if _compiler_is_clang() else ("-lgomp",)


HELPER_FLAGS = ("-O2", "-DNDEBUG", *WARNING_FLAGS)  # tensor_data: no kernel arithmetic in it


@functools.cache
def _cpu_fingerprint() -> str:
    """This CPU's model and flags (-march=native's input): a module built on another CPU is not
    loaded here (a cache directory on a shared disk)."""
    lines: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                if line.startswith(("vendor_id", "model name", "flags", "Features", "CPU part")):
                    lines.append(line.strip())
    except OSError:
        lines.append(platform.processor())
    return "\n".join(lines)


@functools.cache
def _includes(family: str) -> tuple[str, ...]:
    """``csrc/<family>.cpp`` and the ``csrc`` headers it includes (recursively)."""
    todo, seen = [f"{family}.cpp"], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        text = (CSRC / name).read_text()
        included = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', text, re.MULTILINE)
        todo.extend(name for name in included if (CSRC / name).is_file())
    return tuple(seen)


@functools.cache
def _sources_digest(family: str) -> str:
    """A hash of ``csrc/<family>.cpp`` and of the ``csrc`` headers it includes."""
    digest = hashlib.sha256()
    for name in _includes(family):
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    return digest.hexdigest()


def _module_name(family: str, params: dict[str, int], flags: Sequence[str]) -> str:
    key = "\n".join(
        [
            _sources_digest(family),
            family,
            repr(sorted(params.items())),
            " ".join(flags),
            torch.__version__,
            sys.version,
            sysconfig.get_config_var("EXT_SUFFIX") or "",
            _cpu_fingerprint(),
        ]
    )
    shape = "".join(f"_{name}{value}" for name, value in params.items())
    return f"pdserve_{family}{shape}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def describe(family: str, params: dict[str, int]) -> str:
    """``family(name=value, ...)``: how the logs name a build."""
    return family + (f"({', '.join(f'{name}={value}' for name, value in params.items())})" if params else "")


class BuildError(RuntimeError):
    """A kernel did not compile (the message: the compiler's first error; the rest at DEBUG)."""


def _ensure_ninja() -> None:
    """cpp_extension runs ``ninja`` from PATH: add the ninja package's (a virtualenv's bin,
    not on PATH when its python is run by path)."""
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found, import-untyped, unused-ignore]

        candidates.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for directory in candidates:
        if shutil.which("ninja", path=directory):
            os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")
            return


def _first_error(output: str) -> str:
    for line in output.splitlines():
        if re.search(r"\berror\b", line, re.IGNORECASE) and "Error building extension" not in line:
            return line.strip()
    return output.strip().splitlines()[0] if output.strip() else "no output"


def _clear_stale_lock(lock: Path) -> None:
    """Remove the lock file of a build that died (cpp_extension waits on it for ever): no build
    takes ``STALE_LOCK_S``."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _compile(
    family: str,
    params: dict[str, int],
    flags: Sequence[str],
    ldflags: Sequence[str],
    includes: Sequence[Path] = (),
) -> ModuleType:
    """Build (or find built) and import ``csrc/<family>.cpp`` with ``params`` as macros
    (``includes``: directories searched before ``csrc``)."""
    from torch.utils.cpp_extension import load as cpp_load

    name = _module_name(family, params, flags)
    directory = cache_dir() / name
    label = describe(family, params)
    built = (directory / f"{name}.so").exists()
    directory.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(directory / "lock")
    _ensure_ninja()
    defines = [f"-D{MACRO_PREFIX}{key.upper()}={value}" for key, value in params.items()]
    start = time.perf_counter()
    try:
        module = cpp_load(
            name=name,
            sources=[str(CSRC / f"{family}.cpp")],
            extra_cflags=[*flags, *defines],
            extra_ldflags=list(ldflags),
            extra_include_paths=[*map(str, includes), str(CSRC)],
            build_directory=str(directory),
            verbose=os.environ.get("PDSERVE_KERNEL_VERBOSE", "") not in ("", "0"),
            with_cuda=False,
        )
    except Exception as exc:
        output = str(exc)
        logger.debug("building CPU kernel %s failed:\n%s", label, output)
        raise BuildError(f"{label}: {_first_error(output)}") from exc
    elapsed = time.perf_counter() - start
    if built:
        logger.debug("loaded CPU kernel %s from %s (%.3f s)", label, directory, elapsed)
    else:
        logger.info("built CPU kernel %s in %.1f s", label, elapsed)
    assert isinstance(module, ModuleType)
    return module


@functools.cache
def _precompiled_dir() -> Path | None:
    """A directory holding ``PCH_HEADER``'s precompiled copy for ``kernel_flags`` (built once per
    machine: its name hashes what went into it), for the kernels that include it; None where it
    cannot be made (GCC then reads the header itself: slower, the same code). GCC takes a ``.gch``
    only where it was compiled as the including file is (options, the macros it uses), and reads
    the header otherwise; ``-Winvalid-pch`` says so in a verbose build."""
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths

    if _compiler_is_clang():
        return None  # clang's precompiled headers are not found this way
    header = CSRC / PCH_HEADER
    includes = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    # as cpp_extension compiles a source: its flags first, then ours
    command = [get_cxx_compiler(), "-x", "c++-header", *[f"-isystem{path}" for path in includes]]
    command += ["-fPIC", "-std=c++20", *kernel_flags()]
    key = "\n".join([header.read_text(), " ".join(command), torch.__version__, _cpu_fingerprint()])
    directory = cache_dir() / f"pch_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    target = directory / f"{PCH_HEADER}.gch"
    if target.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{PCH_HEADER}.gch.{os.getpid()}"
    start = time.perf_counter()
    try:
        subprocess.run(
            [*command, str(header), "-o", str(partial)], check=True, capture_output=True, text=True, timeout=600
        )
        os.replace(partial, target)  # whole, or not there
    except (OSError, subprocess.SubprocessError) as exc:
        output = getattr(exc, "stderr", "") or str(exc)
        logger.debug("precompiling %s failed (kernels read it instead):\n%s", PCH_HEADER, output)
        partial.unlink(missing_ok=True)
        return None
    logger.info("precompiled %s for the CPU kernels in %.1f s", PCH_HEADER, time.perf_counter() - start)
    return directory


@functools.cache
def _tensor_data_address() -> int | None:
    """The address of ``csrc/tensor_data.cpp``'s C function (None where it did not build)."""
    try:
        helper = _compile("tensor_data", {}, HELPER_FLAGS, ())
        return int(helper.address())
    except Exception as exc:  # noqa: BLE001 - no compiler, torch headers missing ...
        logger.warning(
            "the CPU kernels' tensor reader did not build (%s: %s); kernels read Tensor.data_ptr() (slower calls)",
            type(exc).__name__,
            exc,
        )
        return None


@functools.cache
def _load(family: str, params: tuple[tuple[str, int], ...]) -> ModuleType:
    with _lock:
        includes = []
        if PCH_HEADER in _includes(family):
            precompiled = _precompiled_dir()
            includes = [precompiled] if precompiled is not None else []
        module = _compile(family, dict(params), kernel_flags(), kernel_ldflags(), includes)
        address = _tensor_data_address()
    if address is not None:
        module.use_data_ptr(address)
    return module


def load(family: str, **params: int) -> ModuleType:
    """The module of ``csrc/<family>.cpp`` built with ``params`` (``PD_<NAME>`` macros), once per
    process (and per machine: ``cache_dir()``); raises ``BuildError`` where it does not compile."""
    return _load(family, tuple((name, int(value)) for name, value in params.items()))


def kernel(family: str, **params: int) -> Any:
    """``load(family, **params)``'s kernel: the C++ function, called with tensors, ints and floats."""
    return load(family, **params).kernel


# ---------------------------------------------------------------------------------- self-checks
@dataclass(frozen=True)
class SelfCheck:
    """How ``usable`` tries a kernel: ``build(*key)`` (raises where it does not build), then
    ``check(*key)``: why it differs from aten, None where it does not. ``what`` names the kernel
    in the log ("the {what} kernel ..."), ``stays`` what runs instead. ``warm``: the keys that
    ``python -m workers.backends.cpu.build`` builds and checks."""

    what: str
    stays: str
    build: Callable[..., object]
    check: Callable[..., str | None] | None = None
    warm: tuple[tuple[int, ...], ...] = field(default=((),))


_CHECKS: dict[str, SelfCheck] = {}


def register(name: str, check: SelfCheck) -> None:
    """Register kernel ``name``'s build and check (each family, at import)."""
    _CHECKS[name] = check


def registered() -> dict[str, SelfCheck]:
    return dict(_CHECKS)


def usable(name: str, *key: int) -> bool:
    """Whether kernel ``name`` builds here (for ``key``) and its check finds no difference from
    aten; where not, one WARNING line says why and what stays. Not cached: each family's
    ``*_usable``/``available`` asks once per process (their ``functools.cache``)."""
    entry = _CHECKS[name]
    try:
        entry.build(*key)
    except Exception as exc:  # noqa: BLE001 - no compiler, a compile error, no torch headers ...
        logger.warning(
            "the %s kernel did not build (%s: %s); %s stays", entry.what, type(exc).__name__, exc, entry.stays
        )
        return False
    try:
        why = entry.check(*key) if entry.check is not None else None
    except Exception as exc:  # noqa: BLE001 - a kernel that fails at run time is not used either
        why = f"its check raised {type(exc).__name__}: {exc}"
    if why is not None:
        logger.warning("the %s kernel is not used: %s; %s stays", entry.what, why, entry.stays)
        return False
    return True


def main() -> None:
    """Build and check every registered kernel at its ``warm`` keys (a warm cache for the engine)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # the families register with the imported module, not with this one run as __main__
    from workers.backends.cpu import amx, checksum, fused, paged, panels, prefill  # noqa: F401 - they register
    from workers.backends.cpu import build as loader

    print(f"CPU kernels in {loader.cache_dir()} (torch's CPU capability {torch.backends.cpu.get_cpu_capability()})")
    for name, entry in loader.registered().items():
        for key in entry.warm:
            print(f"  {name}{key if key else ''}: {'usable' if loader.usable(name, *key) else 'not used'}")


if __name__ == "__main__":
    main()
