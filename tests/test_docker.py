"""``docker/Dockerfile`` builds for each supported Megatron release: its build argument picks the
release's Megatron-LM source and NGC image.

Docker does not run here, so the Dockerfile is read the way the builder reads it: arguments
declared before the first ``FROM`` are substituted into ``FROM`` lines, each stage's own
``ARG`` defaults apply inside it, and the final stage is the one ``FROM release-${...}`` names.

Tier: pure.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
# Release -> (NGC image, Megatron-LM git ref): the image each release's CI lists in its
# docker/.ngc_version.* files, and the tag or release branch of the release.
RELEASES = {
    "0.16.1": ("nvcr.io/nvidia/pytorch:25.09-py3", "core_v0.16.1"),
    "0.19": ("nvcr.io/nvidia/pytorch:26.06-py3", "core_r0.19.0"),
}


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    result = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def _substitute(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: variables[m.group(1)], value)


def _arg(declaration: str, build_args: dict[str, str], into: dict[str, str]) -> None:
    name, _, default = declaration.partition("=")
    into[name] = build_args.get(name, default or into.get(name, ""))


def resolve(build_args: dict[str, str]) -> dict[str, str]:
    """The final stage's base image (through named stages) and its environment."""
    global_args: dict[str, str] = {}
    stages: dict[str, dict] = {}
    current: dict | None = None
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "ARG" and current is None:
            _arg(rest, build_args, global_args)
        elif word == "FROM":
            image, _, name = _substitute(rest, global_args).partition(" AS ")
            parent = stages.get(image.strip())
            current = {
                "image": parent["image"] if parent else image.strip(),
                "env": dict(parent["env"]) if parent else {},
                "args": {},
            }
            stages[name.strip() or f"stage{len(stages)}"] = current
        elif word == "ARG":
            _arg(rest, build_args | global_args, current["args"])
        elif word == "ENV":
            scope = global_args | current["env"] | current["args"]
            for key, value in re.findall(r"(\w+)=(\S+)", rest):
                current["env"][key] = _substitute(value, scope)
    assert current is not None, "no FROM in the Dockerfile"
    return {"image": current["image"], **current["env"]}


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_release_argument_picks_its_megatron_and_ngc_image(release: str) -> None:
    image, ref = RELEASES[release]
    built = resolve({"MEGATRON_RELEASE": release})
    assert (built["image"], built["MEGATRON_REF"]) == (image, ref)
    assert built["MEGATRON_RELEASE"] == release


def test_the_default_build_is_a_supported_release() -> None:
    assert resolve({})["MEGATRON_RELEASE"] in RELEASES


def test_image_and_ref_can_be_overridden() -> None:
    built = resolve(
        {"MEGATRON_RELEASE": "0.19", "NGC_IMAGE_0_19": "registry/pytorch:x", "MEGATRON_REF": "v"}
    )
    assert (built["image"], built["MEGATRON_REF"]) == ("registry/pytorch:x", "v")


def test_an_unsupported_release_has_no_stage_to_build() -> None:
    built = resolve({"MEGATRON_RELEASE": "0.12"})
    assert built["image"] == "release-0.12"  # a stage that does not exist: docker refuses


def test_every_stage_clones_the_ref_patches_and_checks_the_entry_point() -> None:
    text = DOCKERFILE.read_text()
    assert '--branch "${MEGATRON_REF}"' in text
    assert 'apply_patch.sh" "${MEGATRON_DIR}"' in text
    assert "calling_convention(t.pretrain)" in text  # the build fails on an unknown pretrain()
    assert "psutil" in text  # Megatron's checkpoint writer needs it


@pytest.mark.parametrize("doc", ["README.md", "docs/MEGATRON.md", "docker/README.md"])
def test_docs_name_every_release_the_dockerfile_builds(doc: str) -> None:
    text = (ROOT / doc).read_text()
    for release in RELEASES:
        assert release in text, (doc, release)
