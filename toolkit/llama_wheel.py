"""Build (and install) llama-cpp-python 0.3.36 with tuneport's patches to the llama.cpp it vendors.

The patches (``llama_cpp_patches/``, each with a header saying what it changes and why) give llama.cpp per-sequence
LoRA, which ``serve --engine llamacpp`` uses to decode requests for different adapters in one batch. The wheel's
version carries a local label with the patches' hash (``0.3.36+tuneport.<hash>``), so a stock wheel is never
mistaken for it and a change of patch builds a new one; built wheels are cached (``~/.cache/tuneport/wheels``).

Standard library only: the Makefile runs this file as a script before tuneport is installed
(``python toolkit/llama_wheel.py --install``); users run ``tuneport llama-wheel --install``. ``CMAKE_ARGS`` passes
through as in any llama-cpp-python build (``-DGGML_CUDA=on``, ``-DGGML_METAL=on``); without it the build uses
portable x86 CPU flags (AVX2/FMA/F16C; a native build dies with SIGILL in the AMX path on some VMs).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a file: its folder off the path (toolkit/inspect.py would shadow the stdlib's)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse
import hashlib
import json
import logging
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tuneport.toolkit.llama_wheel")

LLAMA_CPP_VERSION = "0.3.36"
PATCH_DIR = Path(__file__).resolve().with_name("llama_cpp_patches")
DEFAULT_WHEEL_DIR = Path.home() / ".cache" / "tuneport" / "wheels"
X86_CPU_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                      "-DGGML_SSE42=ON")
BUILD_LOG_TAIL = 20


try:  # a UserError (exit 2) once tuneport is installed; the Makefile runs this file before it is
    from tuneport.convert.errors import UserError as _ErrorBase
except ImportError:
    _ErrorBase = RuntimeError  # type: ignore[misc,assignment]


class LlamaWheelError(_ErrorBase):
    """A build that cannot go on: the message says what failed and what to do."""


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def patch_hash() -> str:
    """The first 10 hex digits of SHA-256 over the patches' bytes, in name order."""
    digest = hashlib.sha256()
    for p in patch_files():
        digest.update(p.read_bytes())
    return digest.hexdigest()[:10]


def wheel_version() -> str:
    return f"{LLAMA_CPP_VERSION}+tuneport.{patch_hash()}"


def default_cmake_args() -> str:
    """``CMAKE_ARGS`` from the environment, else portable CPU flags on x86 (elsewhere llama.cpp's defaults)."""
    if os.environ.get("CMAKE_ARGS"):
        return os.environ["CMAKE_ARGS"]
    return X86_CPU_CMAKE_ARGS if platform.machine().lower() in ("x86_64", "amd64") else ""


@dataclass
class LlamaWheelOptions:
    wheel_dir: Path = DEFAULT_WHEEL_DIR
    cmake_args: str = field(default_factory=default_cmake_args)
    install: bool = False  # pip-install the wheel into this Python (with its dependencies)
    rebuild: bool = False  # build even when the cache holds the wheel
    stock: bool = False  # llama-cpp-python as PyPI ships it, no patches (the test suite's reference for the fallback)
    python: str = sys.executable


def cached_wheel(wheel_dir: Path, version: str | None = None) -> Path | None:
    version = version or wheel_version()
    found = sorted(Path(wheel_dir).glob(f"llama_cpp_python-{version}-*.whl"))
    return found[-1] if found else None


def build_llama_wheel(options: LlamaWheelOptions | None = None, /, **fields) -> dict:
    """The patched wheel in ``wheel_dir`` (built unless cached), installed when ``install``; returns what was done."""
    opts = options or LlamaWheelOptions(**fields)
    if not patch_files():
        raise LlamaWheelError(f"no patches in {PATCH_DIR}: reinstall tuneport")
    version = LLAMA_CPP_VERSION if opts.stock else wheel_version()
    wheel_dir = Path(opts.wheel_dir).expanduser()
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheel = None if opts.rebuild else cached_wheel(wheel_dir, version)
    started = time.monotonic()
    built = wheel is None
    if built:
        wheel = _build(opts, version, wheel_dir)
    else:
        log.info("llama-cpp-python %s: using the cached wheel %s", version, wheel)
    if opts.install:
        log.info("installing %s", wheel.name)
        _run([opts.python, "-m", "pip", "install", "-q", str(wheel)], "installing the wheel")  # with its dependencies
    return {"version": version, "wheel": str(wheel), "built": built, "installed": opts.install,
            "cmake_args": opts.cmake_args, "patches": [] if opts.stock else [p.name for p in patch_files()],
            "seconds": round(time.monotonic() - started, 1)}


def _build(opts: LlamaWheelOptions, version: str, wheel_dir: Path) -> Path:
    if shutil.which("patch") is None and not opts.stock:
        raise LlamaWheelError("the `patch` program is needed to apply tuneport's patches: install it (e.g. apt "
                              "install patch) and run again")
    with tempfile.TemporaryDirectory(prefix="tuneport-llama-wheel-") as tmp:
        work = Path(tmp)
        log.info("downloading the llama-cpp-python %s sdist", LLAMA_CPP_VERSION)
        _run([opts.python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python", "-d",
              str(work), f"llama-cpp-python=={LLAMA_CPP_VERSION}"], "downloading the sdist (needs the package index)")
        with tarfile.open(work / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz") as tar:
            tar.extractall(work, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        src = work / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
        for p in [] if opts.stock else patch_files():
            log.info("applying %s", p.name)
            _run(["patch", "-s", "-p1", "-d", str(src / "vendor" / "llama.cpp"), "-i", str(p)],
                 f"applying {p.name} (it was written for llama-cpp-python {LLAMA_CPP_VERSION})")
        init = src / "llama_cpp" / "__init__.py"
        init.write_text(re.sub(r'^__version__ = .*$', f'__version__ = "{version}"', init.read_text(), flags=re.M))
        env = {**os.environ, "CMAKE_ARGS": opts.cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
        log.info("building llama-cpp-python %s (CMAKE_ARGS=%r; 5-14 min on 2 cores)", version, opts.cmake_args)
        out = work / "wheel"
        _run([opts.python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", "-w", str(out), str(src)],
             "building the wheel (a C/C++ compiler and CMake are needed)", env=env, log_to=work / "build.log")
        built = next(out.glob("llama_cpp_python-*.whl"), None)
        if built is None:
            raise LlamaWheelError(f"pip wheel wrote no wheel into {out}")
        final = wheel_dir / built.name
        partial = wheel_dir / f".{built.name}.partial"  # same directory: the rename is atomic
        shutil.copyfile(built, partial)
        os.replace(partial, final)
        log.info("built %s", final)
        return final


def _run(cmd: list[str], what: str, env: dict | None = None, log_to: Path | None = None) -> None:
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log_to is not None:
        log_to.write_text(done.stdout)
    if done.returncode != 0:
        tail = [line for line in done.stdout.splitlines() if line.strip()][-BUILD_LOG_TAIL:]
        for line in tail:
            log.error("  %s", line)
        last = tail[-1].strip() if tail else f"exit code {done.returncode}"
        raise LlamaWheelError(f"{what} failed: {last}")


def main(argv: list[str] | None = None) -> int:
    """The Makefile's entry point (the same options as ``tuneport llama-wheel``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel-dir", type=Path, default=DEFAULT_WHEEL_DIR)
    ap.add_argument("--cmake-args", default=None, help="default: $CMAKE_ARGS, else portable x86 CPU flags")
    ap.add_argument("--install", action="store_true")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--stock", action="store_true", help="no patches: PyPI's llama-cpp-python (the tests' reference)")
    ap.add_argument("--print-version", action="store_true", help="print the patched wheel's version and stop")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.print_version:
        print(wheel_version())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    opts = LlamaWheelOptions(wheel_dir=args.wheel_dir, install=args.install, rebuild=args.rebuild, stock=args.stock)
    if args.cmake_args is not None:
        opts.cmake_args = args.cmake_args
    try:
        report = build_llama_wheel(opts)
    except LlamaWheelError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    print(json.dumps(report) if args.json else f"llama-cpp-python {report['version']}: {report['wheel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
