"""The container image has every Debian library its native code links against (without Docker:
see ``image_runtime`` for how the Dockerfile, the installed wheels and Debian's data are read)."""

from __future__ import annotations

import re

from image_runtime import DOCKERFILE, image_needs, load_debian, missing_from_image, parse_dockerfile

from backend.transport.mooncake import SYSTEM_PACKAGES

MOONCAKE_LIBRARIES = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1"}


def _dockerfile() -> str:
    return DOCKERFILE.read_text(encoding="utf-8")


def test_the_dockerfile_is_read_as_docker_runs_it() -> None:
    recipe = parse_dockerfile(_dockerfile())
    assert recipe.base == "python:3.11-slim-bookworm"
    assert {"libibverbs1", "libnuma1", "libcurl4"} <= recipe.apt_packages
    assert recipe.pip_requirements == ("torch==2.13.0", ".[mooncake]")
    text = "FROM x\nRUN apt-get update && apt-get install -y \\\n  a \\\n  b && rm -rf /y\n"
    assert parse_dockerfile(text).apt_packages == {"a", "b"}


def test_every_library_the_image_needs_comes_from_its_packages() -> None:
    recipe = parse_dockerfile(_dockerfile())
    needs, objects = image_needs(recipe)
    # The scan reaches the transfer engine and torch, not only pure-Python packages.
    assert objects > 50
    users = needs.by_library["libibverbs.so.1"]
    assert "mooncake/engine.so" in users, users
    assert "libcurl.so.4" in needs.by_library
    assert missing_from_image(recipe, needs, load_debian()) == []


def test_a_library_left_out_of_the_dockerfile_is_reported() -> None:
    """Each of Mooncake's libraries, dropped from the apt-get line, fails the check by name."""
    recipe = parse_dockerfile(_dockerfile())
    needs, _ = image_needs(recipe)
    for library, package in {**MOONCAKE_LIBRARIES, "libcurl.so.4": "libcurl4"}.items():
        text = re.sub(rf"\s{re.escape(package)}\b", "", _dockerfile())
        missing = missing_from_image(parse_dockerfile(text), needs, load_debian())
        assert [(m.library, m.package) for m in missing] == [(library, package)]
        assert "mooncake/engine.so" in missing[0].needed_by


def test_a_library_debian_data_does_not_know_fails_until_refreshed() -> None:
    recipe = parse_dockerfile(_dockerfile())
    needs, _ = image_needs(recipe)
    needs.by_library["libnew.so.7"] = ["somewheel/_native.so"]
    missing = missing_from_image(recipe, needs, load_debian())
    assert [(m.library, m.package) for m in missing] == [("libnew.so.7", None)]


def test_the_transports_load_error_names_the_packages_mooncake_needs() -> None:
    """The packages MooncakeTransport names when its native module cannot load are exactly
    those its shared objects need beyond the base image."""
    needs, _ = image_needs(parse_dockerfile(_dockerfile()))
    debian = load_debian()
    mooncake = {
        debian["libraries"][library]
        for library, users in needs.by_library.items()
        if any(u.startswith("mooncake") for u in users)
    }
    assert mooncake - set(debian["base_packages"]) == set(SYSTEM_PACKAGES)
