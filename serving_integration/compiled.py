"""The replay's hot modules, compiled by Cython from their own source files, and the import hook
that serves a compiled module only while it is the build of the source as it is now.

    python -m serving_integration.build_compiled          # what `make setup` runs (a second when up to date)
    python -m serving_integration.build_compiled status   # which modules run compiled

Nothing here is a second implementation: the files of `MODULES` are compiled as they are (Cython,
annotations ignored, so the compiled code keeps Python's semantics: the same ints, floats and dict
types, and every replay gives the same numbers; tests/simulator/test_compiled.py compares them), into
`BUILD_DIR`, each extension named by a digest of the source bytes it was built from. A module may
have C declarations beside it (Cython's augmenting `.pxd`: its classes' fields as extension types,
and `cython.locals` in the .py typing the hot loops' locals as those classes), read only by the
build and part of the digest; a field keeps its Python type (object, or a C double or integer where
the .py only ever stores one), so the numbers stay the same. At import, `CompiledFinder` looks for
the extension whose digest is that of the .py (and .pxd) file now: an edited module runs
interpreted until the next build, never a stale build. A .pxd may cimport another module's
declarations (the engine reads the tree's nodes, the workload's calls as C structs): the build's
name then covers that module's current source and declarations too (and theirs, transitively),
so editing it sends both back to the interpreter until the next build. PBKV_COMPILED=0 turns
both the build and the hook off (to profile the Python with cProfile or py-spy, which do not see into the
extensions, or to compare the two).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

# Where the replay spends its time (benchmarks/simulator_speed.py): the event loop and the tree, the
# bound's interval extraction, the policies, the trust judge, the predictions' tables, the field's
# baselines, the router, the workload's calls
MODULES = (
    "serving_integration.simulator.engine",
    "serving_integration.simulator.radix",
    "serving_integration.simulator.bound",
    "serving_integration.cache.policies",
    "serving_integration.cache.trust",
    "serving_integration.cache.predictions",
    "serving_integration.cache.baselines",
    "serving_integration.cache.router",
    "serving_integration.cache.workload",
    "serving_integration.simulator.cost_model",
)
# Python semantics kept whole: annotations are not C types (Cython would otherwise reject a
# defaultdict where a dict is annotated); binding: functions inspect and pickle can read (Cython 3's
# default, written down since the digest names it); division and indexing stay Cython's defaults,
# Python's
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "binding": True}
ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / ".cache" / "compiled"
SWITCH = "PBKV_COMPILED"  # "0": interpreted, no build


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def source_file(name: str) -> Path:
    return ROOT.joinpath(*name.split(".")).with_suffix(".py")


def declarations_file(name: str) -> Path:
    """The module's C declarations for its build (Cython's augmenting .pxd beside the .py: types for
    its classes' fields and locals, no code), where it has one."""
    return source_file(name).with_suffix(".pxd")


def declarations(name: str) -> bytes:
    path = declarations_file(name)
    return path.read_bytes() if path.is_file() else b""


def cimported(declared: bytes) -> list[str]:
    """The modules of MODULES whose declarations `declared` cimports (`from X cimport ...`): a build
    reads their struct layouts, so it is a build of their current sources too."""
    named = re.findall(rb"^\s*from\s+([\w.]+)\s+cimport\b", declared, flags=re.MULTILINE)
    return [name for name in (n.decode() for n in named) if name in MODULES]


def digest(source: bytes, declared: bytes = b"") -> str:
    """Names a build: the source's bytes, its declarations', the directives it was compiled with,
    and the current sources and declarations of every module its declarations cimport, directly or
    through others (edit one of those and this module too runs interpreted until rebuilt, never
    against an older layout). Read as a set, so a cimport cycle ends."""
    h = hashlib.blake2b(digest_size=10)
    h.update(repr(sorted(DIRECTIVES.items())).encode() + b"\x00" + source)
    if declared:
        h.update(b"\x00pxd\x00" + declared)
    for name in sorted(reached(cimported(declared))):
        h.update(b"\x00cimport\x00" + name.encode() + b"\x00" + source_file(name).read_bytes()
                 + b"\x00pxd\x00" + declarations(name))
    return h.hexdigest()


def reached(names: list[str]) -> list[str]:
    """`names` and every module their declarations cimport, theirs, and so on (each once)."""
    found, todo = [], list(names)
    while todo:
        other = todo.pop()
        if other not in found:
            found.append(other)
            todo.extend(cimported(declarations(other)))
    return found


def upstream(name: str) -> list[str]:
    """Every module whose declarations `name`'s build reads: those it cimports, theirs, and so on."""
    return reached(cimported(declarations(name)))


def build_file(name: str, source: bytes, declared: bytes = b"") -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # this interpreter's ABI, e.g. .cpython-311-x86_64-linux-gnu.so
    return BUILD_DIR / f"{name}.{digest(source, declared)}{suffix}"


def compiled_path(name: str, source: bytes | None = None, declared: bytes | None = None) -> Path | None:
    """The build of module `name` from `source` and `declared` (default: its .py and .pxd files
    now), or None if there is none."""
    try:
        source = source_file(name).read_bytes() if source is None else source
        declared = declarations(name) if declared is None else declared
    except OSError:
        return None
    path = build_file(name, source, declared)
    return path if path.is_file() else None


class CompiledLoader(importlib.machinery.ExtensionFileLoader):
    """Loads a build; its source is the .py it was built from, so tracebacks and `inspect` show
    that file's lines."""

    def get_source(self, fullname):
        return source_file(fullname).read_text()


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Serves a module of MODULES from its build when the build is of its current source; else
    returns None and the normal finders load the .py."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        built = compiled_path(fullname)
        if built is None:
            return None
        loader = CompiledLoader(fullname, str(built))
        return importlib.util.spec_from_file_location(fullname, built, loader=loader)


def install() -> None:
    """Put the finder first on sys.meta_path (serving_integration/__init__.py does, once)."""
    if enabled() and not any(isinstance(f, CompiledFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CompiledFinder())


def build(jobs: int = 2) -> list[str]:
    """Compile every module of MODULES whose current source has no build; remove builds of older
    sources. Each extension is compiled from a copy of the bytes it is named by and moved into
    BUILD_DIR whole (os.replace), so a file there is always a complete build of its digest's source.
    Returns the modules built."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    sources = {name: (source_file(name).read_bytes(), declarations(name)) for name in MODULES}
    todo = {name: both for name, both in sources.items() if compiled_path(name, *both) is None}
    if todo:
        with tempfile.TemporaryDirectory(dir=BUILD_DIR) as tmp:
            extensions = []
            for name, (source, declared) in todo.items():
                copy = Path(tmp, "src", *name.split(".")).with_suffix(".py")
                copy.parent.mkdir(parents=True, exist_ok=True)
                copy.write_bytes(source)
                if declared:
                    copy.with_suffix(".pxd").write_bytes(declared)
                for other in upstream(name):  # the layouts it reads, as the digest names them
                    other_copy = Path(tmp, "src", *other.split(".")).with_suffix(".pxd")
                    other_copy.parent.mkdir(parents=True, exist_ok=True)
                    other_copy.write_bytes(sources[other][1])
                extensions.append(Extension(name, [str(copy.relative_to(Path(tmp, "src")))]))
            # from inside the copies' root, Cython records each file as serving_integration/...py: a
            # traceback then shows the lines of the real file (on sys.path), which is that very source
            with contextlib.chdir(Path(tmp, "src")):
                modules = cythonize(extensions, compiler_directives=DIRECTIVES, build_dir=str(Path(tmp, "c")),
                                    quiet=True, force=True, nthreads=jobs)
            command = build_ext(Distribution({"ext_modules": modules}))
            command.build_lib, command.build_temp, command.parallel = str(Path(tmp, "lib")), str(Path(tmp, "o")), jobs
            command.ensure_finalized()
            command.run()
            for name, both in todo.items():
                os.replace(command.get_ext_fullpath(name), build_file(name, *both))
    current = {build_file(name, *both).name for name, both in sources.items()}
    for old in BUILD_DIR.iterdir():
        if old.is_file() and old.name not in current:
            old.unlink()
    return list(todo)


def loaded() -> list[str]:
    """The modules of MODULES this process imported from their builds."""
    return [name for name in MODULES if not str(getattr(sys.modules.get(name), "__file__", ".py")).endswith(".py")]


def status() -> dict[str, str]:
    """Per module: the build it runs from, or why it runs interpreted."""
    if not enabled():
        return {name: f"interpreted ({SWITCH}=0)" for name in MODULES}
    return {name: str(compiled_path(name) or "interpreted (no build of the current source: make setup)")
            for name in MODULES}
