"""What the container image's native code needs from Debian, checked without Docker.

The check, in order:
1. read the Dockerfile: its base image, the Debian packages its ``apt-get install`` lines install
   and the requirements its ``pip install`` lines install;
2. resolve those requirements to Python distributions in this environment (the image installs the
   same pins for the same Python minor version on the same Debian release);
3. list every ELF shared object those distributions ship, and read each one's dynamic section
   (``DT_NEEDED``, ``DT_RPATH``/``DT_RUNPATH``) with the small reader below;
4. resolve each needed library the way the loader does inside the environment (RPATH/RUNPATH
   with ``$ORIGIN``, or a library some other shipped object already provides by that name);
5. every library left must come from a Debian package the image has: one in the base image
   (bookworm's ``minbase``, which ``debian:bookworm-slim`` under ``python:3.11-slim-bookworm`` is
   built from) or one the Dockerfile installs. Which package provides which library, and the
   minbase package list, are Debian's own data, recorded in ``fixtures/image_libraries.json``
   by ``python tests/ops/image_runtime.py --refresh`` (``dpkg -S`` on a bookworm host, and
   ``debootstrap --print-debs --variant=minbase bookworm``).

What it cannot see: libraries opened with ``dlopen`` by name at run time (CUDA's driver on GPU
hosts, RDMA providers), which no dynamic section lists.
"""

from __future__ import annotations

import argparse
import json
import mmap
import re
import shlex
import struct
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
FIXTURE = Path(__file__).parent / "fixtures" / "image_libraries.json"
PROJECT = "kvguard"

# -- 1. the Dockerfile ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImageRecipe:
    base: str
    apt_packages: frozenset[str]
    pip_requirements: tuple[str, ...]  # "torch==2.13.0", ".[mooncake]"


def _run_commands(dockerfile: str) -> Iterator[str]:
    """Each RUN instruction's shell text, continuation lines joined, comments dropped."""
    lines = [ln for ln in dockerfile.splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    for line in text.splitlines():
        if line.strip().upper().startswith("RUN "):
            yield line.strip()[4:]


def _arguments_after(words: list[str], command: tuple[str, ...]) -> Iterator[list[str]]:
    """The non-option arguments of each ``command`` (a word sequence) in a shell command list."""
    n = len(command)
    for i in range(len(words) - n + 1):
        if tuple(words[i : i + n]) != command:
            continue
        args: list[str] = []
        for word in words[i + n :]:
            if word in ("&&", "||", ";", "|"):
                break
            if word.startswith("-"):
                continue
            args.append(word)
        yield args


def parse_dockerfile(text: str) -> ImageRecipe:
    base = next(ln.split()[1] for ln in text.splitlines() if ln.strip().upper().startswith("FROM "))
    apt: set[str] = set()
    pip: list[str] = []
    for command in _run_commands(text):
        words = shlex.split(command.replace(";", " ; "))
        for args in _arguments_after(words, ("apt-get", "install")):
            apt.update(args)
        for args in _arguments_after(words, ("pip", "install")):
            # --index-url takes a value: drop URLs, keep requirements.
            pip.extend(a for a in args if "://" not in a)
    return ImageRecipe(base, frozenset(apt), tuple(pip))


# -- 2. the distributions those requirements install ----------------------------------------------


def _requirement(spec: str) -> Requirement:
    if spec.startswith("."):  # the project itself, maybe with extras: ".[mooncake]"
        return Requirement(PROJECT + spec[1:])
    return Requirement(spec)


def distributions(specs: Iterable[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``specs`` pull in, dependencies and extras included."""
    found: dict[str, metadata.Distribution] = {}
    todo = [(_requirement(s), "") for s in specs]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = metadata.distribution(name)
        first = name not in found
        found[name] = dist
        # Each extra asked for adds its own requirements (visited once per extra).
        for wanted in ("", *sorted(req.extras)) if first else sorted(req.extras):
            for line in dist.requires or []:
                todo.append((Requirement(line), wanted))
    return found


# -- 3. ELF dynamic sections -----------------------------------------------------------------------

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NEEDED, DT_STRTAB, DT_SONAME, DT_RPATH, DT_RUNPATH = 1, 5, 14, 15, 29


@dataclass(frozen=True, slots=True)
class SharedObject:
    path: Path
    soname: str | None
    needed: tuple[str, ...]
    search: tuple[Path, ...]  # RPATH then RUNPATH directories, $ORIGIN expanded


def _string(data: mmap.mmap, offset: int) -> str:
    end = data.find(b"\0", offset)
    return data[offset:end].decode()


def read_elf(path: Path) -> SharedObject | None:
    """The dynamic section of a 64-bit little-endian ELF file; None for anything else."""
    with open(path, "rb") as f:
        if f.read(6) != b"\x7fELF\x02\x01":
            return None
        f.seek(0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _dynamic(path, data)


def _dynamic(path: Path, data: mmap.mmap) -> SharedObject | None:
    phoff, phentsize, phnum = (
        struct.unpack_from("<Q", data, 32)[0],
        *struct.unpack_from("<HH", data, 54),
    )
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_filesz, p_offset))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return None
    entries: list[tuple[int, int]] = []
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        entries.append((tag, value))
    strtab_vaddr = next(v for t, v in entries if t == DT_STRTAB)
    strtab = next(o + strtab_vaddr - a for a, size, o in loads if a <= strtab_vaddr < a + size)

    def strings(tag: int) -> list[str]:
        return [_string(data, strtab + v) for t, v in entries if t == tag]

    origin = str(path.parent)
    dirs = [d for tag in (DT_RPATH, DT_RUNPATH) for s in strings(tag) for d in s.split(":")]
    search = tuple(Path(d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)) for d in dirs)
    sonames = strings(DT_SONAME)
    return SharedObject(path, sonames[0] if sonames else None, tuple(strings(DT_NEEDED)), search)


def shared_objects(dists: Iterable[metadata.Distribution]) -> list[SharedObject]:
    objects = []
    for dist in dists:
        for file in dist.files or []:
            name = file.name
            if not (name.endswith(".so") or ".so." in name):
                continue
            path = Path(str(dist.locate_file(file)))
            if path.is_file() and (obj := read_elf(path)) is not None:
                objects.append(obj)
    return objects


# -- 4./5. what the system must provide -----------------------------------------------------------


@dataclass(slots=True)
class SystemNeeds:
    """Libraries no shipped object provides: soname -> the shipped objects needing it."""

    by_library: dict[str, list[str]] = field(default_factory=dict)


def system_libraries(objects: list[SharedObject], site: Path) -> SystemNeeds:
    """Needed sonames the environment does not provide itself."""
    shipped = {o.path.name for o in objects} | {o.soname for o in objects if o.soname}
    needs = SystemNeeds()
    for obj in objects:
        for name in obj.needed:
            if any((d / name).is_file() for d in obj.search) or name in shipped:
                continue
            who = str(obj.path.relative_to(site)) if obj.path.is_relative_to(site) else str(obj)
            needs.by_library.setdefault(name, []).append(who)
    return needs


@dataclass(frozen=True, slots=True)
class Missing:
    library: str
    package: str | None  # None: the fixture does not know the library (refresh it)
    needed_by: tuple[str, ...]


def missing_from_image(recipe: ImageRecipe, needs: SystemNeeds, debian: dict) -> list[Missing]:
    """Libraries the image would not have: no package of the base image or the Dockerfile."""
    have = set(debian["base_packages"]) | recipe.apt_packages
    missing = []
    for library, users in sorted(needs.by_library.items()):
        package = debian["libraries"].get(library)
        if package is None or package not in have:
            missing.append(Missing(library, package, tuple(sorted(users)[:3])))
    return missing


def image_needs(recipe: ImageRecipe) -> tuple[SystemNeeds, int]:
    """(system libraries the image's native code needs, how many shared objects were read)."""
    dists = distributions(recipe.pip_requirements).values()
    objects = shared_objects(dists)
    site = Path(str(metadata.distribution("torch").locate_file("")))
    return system_libraries(objects, site), len(objects)


def load_debian() -> dict:
    return dict(json.loads(FIXTURE.read_text(encoding="utf-8")))


# -- the fixture, from Debian's own data ----------------------------------------------------------


def _provider(library: str) -> str:
    """The Debian package whose files include ``library`` (from the loader cache and dpkg)."""
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    paths = [
        line.split(" => ")[1]
        for line in cache.splitlines()
        if line.strip().split(" ")[0] == library and "x86-64" in line
    ]
    for path in paths:
        done = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout.split(":")[0]
        resolved = str(Path(path).resolve())
        done = subprocess.run(["dpkg", "-S", resolved], capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout.split(":")[0]
    raise SystemExit(f"no Debian package on this host provides {library}")


def _minbase(suite: str) -> list[str]:
    done = subprocess.run(
        ["debootstrap", "--print-debs", "--variant=minbase", suite, "/tmp/kvguard-minbase-print"],
        capture_output=True,
        text=True,
        check=True,
    )
    return sorted(done.stdout.split())


def refresh() -> None:
    """Rewrite the fixture on a Debian bookworm host with the image's environment installed."""
    recipe = parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))
    needs, _ = image_needs(recipe)
    release = Path("/etc/debian_version").read_text().strip()
    data = {
        "source": "Debian bookworm: `dpkg -S` of each library on a bookworm "
        f"{release} host; base_packages from `debootstrap --print-debs --variant=minbase "
        "bookworm` (debian:bookworm-slim, the base of python:3.11-slim-bookworm, is a minbase "
        "debootstrap). Regenerate: python tests/ops/image_runtime.py --refresh",
        "base_packages": _minbase("bookworm"),
        "libraries": {lib: _provider(lib) for lib in sorted(needs.by_library)},
    }
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE.relative_to(REPO)}: {len(data['libraries'])} libraries")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--refresh", action="store_true", help="rewrite the fixture")
    args = parser.parse_args(argv)
    if args.refresh:
        refresh()
        return 0
    recipe = parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))
    needs, count = image_needs(recipe)
    missing = missing_from_image(recipe, needs, load_debian())
    print(f"{count} shared objects; system libraries: {', '.join(sorted(needs.by_library))}")
    for m in missing:
        print(f"missing: {m.library} (package {m.package}) needed by {', '.join(m.needed_by)}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
