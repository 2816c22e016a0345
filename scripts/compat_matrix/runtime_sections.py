"""The tensordict, torch_npu, megatron-core, Megatron-Bridge, verl and torch sections: each runtime
patch against the releases of the one project it patches, and, for a patch whose check also reads torch's own code,
that rule against torch's releases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compat_matrix.fetch import CACHE, Artifact, extract
from compat_matrix.table import STATE_TEXT, Rows, Section, read_files, static_patches, static_rows

# ----------------------------------------------------------------------------- verl runtime fixes
# tensordict / torch_npu / megatron-core / megatron-bridge / verl / torch, one release list per project.
#: Project → the package folder it installs; a patch whose static rule (or one of its ``also`` rules)
#: reads a file under that folder is decided on the project's releases, by that rule. Megatron-Bridge
#: installs under megatron-core's ``megatron``: a file belongs to the project of the longest folder
#: holding it (:func:`project_of`).
RUNTIME_PACKAGES = {
    "tensordict": "tensordict",
    "torch-npu": "torch_npu",
    "megatron-core": "megatron",
    "megatron-bridge": "megatron/bridge",
    "verl": "verl",
    "torch": "torch",
}


def project_of(file: str) -> str | None:
    """The runtime project whose package folder holds ``file`` (the longest such folder), or ``None``."""
    holding = [p for p, folder in RUNTIME_PACKAGES.items() if file.startswith(folder + "/")]
    return max(holding, key=lambda p: len(RUNTIME_PACKAGES[p]), default=None)


def runtime_files(project: str) -> tuple[str, ...]:
    """The files of ``project`` the static rules read (``StaticRule.reads``)."""
    top = RUNTIME_PACKAGES[project].split("/")[0]
    return tuple(f for f in read_files(top) if project_of(f) == project)


_MEGATRON_TAG = "cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64"
#: torch has no sdist and its Linux wheels are CUDA builds of 0.8-1 GB: its Python files are read
#: from the macOS arm64 wheels (67-139 MB; pure-Python files are the same on every platform).
_TORCH_TAGS = ("cp311-cp311-macosx_14_0_arm64.whl", "cp311-none-macosx_11_0_arm64.whl")
#: Releases read for them, oldest first per project (wheels; megatron-core >= 0.17 needs Python
#: 3.12 to install but its files read the same). torch: the last release before the 2.8 boundary of
#: ``megatron.async_save_format``, the first after it, the test environments' 2.13.0, the newest.
#: megatron-bridge: every final release (0.4.0 on need Python 3.12 to install; their files read the same).
RUNTIME_RELEASES: tuple[Artifact, ...] = (
    *(
        Artifact("tensordict", v, f"tensordict-{v}-cp311-cp311-manylinux_2_28_x86_64.whl")
        for v in ("0.8.0", "0.8.3", "0.9.1", "0.10.0")
    ),
    Artifact("tensordict", "0.15.3", "tensordict-0.15.3-py3-none-any.whl"),
    *(
        Artifact("torch-npu", v, f"torch_npu-{v}-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
        for v in ("2.1.0.post17", "2.5.1.post1", "2.6.0.post5")
    ),
    *(
        Artifact("torch-npu", v, f"torch_npu-{v}-cp311-cp311-manylinux_2_28_x86_64.whl")
        for v in ("2.7.1.post11", "2.9.1", "2.12.0.post3", "2.13.0", "2.14.0")
    ),
    *(
        Artifact("megatron-core", v, f"megatron_core-{v}-{_MEGATRON_TAG}.whl")
        for v in ("0.12.1", "0.13.1", "0.14.0", "0.15.3", "0.16.0", "0.16.1", "0.17.0rc0", "0.17.0", "0.19.2")
    ),
    *(
        Artifact("megatron-bridge", v, f"megatron_bridge-{v}-py3-none-any.whl")
        for v in ("0.3.0", "0.3.1", "0.4.0", "0.4.1", "0.4.2", "0.5.0", "0.5.1", "0.6.0", "0.6.1", "0.6.2")
    ),
    *(Artifact("verl", v, f"verl-{v}-py3-none-any.whl") for v in ("0.8.0", "0.9.0", "0.9.1")),
    *(Artifact("torch", v, f"torch-{v}-{_TORCH_TAGS[1]}") for v in ("2.7.1", "2.8.0")),
    *(Artifact("torch", v, f"torch-{v}-{_TORCH_TAGS[0]}") for v in ("2.13.0", "2.15.0")),
)


def _runtime_section(project: str, prefer: tuple[str, ...]) -> Section:
    """The watched section of one runtime project: its columns are its releases in
    :data:`RUNTIME_RELEASES`, its rows the patches with a static rule reading its package, each
    decided by that rule."""

    def reading(rule: Any) -> bool:
        return any(project_of(f) == project for f in rule.reads)

    def rule_of(patch: Any) -> Any:
        return next(rule for rule in patch.static.rules() if reading(rule))

    def tree(artifact: Artifact, cache: Path) -> Any:
        from verl_npu_autopatch.authoring.fingerprints import UpstreamTree

        return UpstreamTree((extract(artifact, runtime_files(project), cache),), {project: artifact.version})

    def rows_of(trees: dict[str, Any]) -> Rows:
        patches = [p for p in static_patches() if any(reading(rule) for rule in p.static.rules())]
        return static_rows(patches, trees, rule_of)

    return Section(
        title=project,
        project=project,
        intro=(),
        columns=tuple(a for a in RUNTIME_RELEASES if a.project == project),
        tree=tree,
        rows_of=rows_of,
        states=STATE_TEXT,
        prefer=prefer,
    )


RUNTIME_SECTIONS: list[Section] = [
    _runtime_section("tensordict", ("cp311-cp311-manylinux_2_28_x86_64.whl", "py3-none-any.whl")),
    _runtime_section(
        "torch-npu",
        ("cp311-cp311-manylinux_2_28_x86_64.whl", "cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"),
    ),
    _runtime_section("megatron-core", (f"{_MEGATRON_TAG}.whl", "py3-none-any.whl")),
    _runtime_section("megatron-bridge", ("py3-none-any.whl",)),
    _runtime_section("verl", ("py3-none-any.whl",)),
    _runtime_section("torch", _TORCH_TAGS),
]


def compute_runtime(cache: Path = CACHE) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """``[(project, patch name, [(version, state, reason)])]`` for the verl runtime-fix patches
    (and the torch side of those whose check reads torch's code)."""
    rows = []
    for section in RUNTIME_SECTIONS:
        for name, _groups, cells in section.compute(cache):
            rows.append((section.project, name, [(v, *cells[v]) for v in (a.version for a in section.columns)]))
    return rows


def render_runtime(rows: list[tuple[str, str, list[tuple[str, str, str]]]]) -> str:
    """The section of the document for the tensordict / torch_npu / megatron-core / Megatron-Bridge / verl patches,
    then torch's side of those whose check reads torch's code."""
    lines = [
        "",
        "## tensordict, torch_npu, megatron-core, Megatron-Bridge, verl and torch",
        "",
        "The same for the patches of verl's other NPU runtime fixes (and of fixes to verl's own code),",
        "each against the releases of the one project it patches (wheels from PyPI, sha256-checked,",
        "read with `ast`, never installed). Megatron-Bridge installs under megatron-core's `megatron`",
        "package: a rule reading `megatron/bridge/...` is decided on Megatron-Bridge's releases only.",
        "",
        "Two of them also read torch's own code, so a second row of each (the last ones) decides",
        "that side on torch's releases with the same rule the live check runs:",
        "`megatron.async_save_format` applies only where both megatron-core's writer omits",
        "`serialization_format` and torch's `_write_item` requires it; `torch_npu.nested_tensor_intercept`,",
        "where torch_npu intercepts nothing, is fixed upstream only while `torch.nested`'s functions are",
        "torch's own plain ones. torch has no sdist and its Linux wheels are CUDA builds, so its files",
        "are read from the macOS arm64 wheels (the pure-Python files are the same on every platform).",
        "",
    ]
    for project, name, cells in rows:
        lines += [
            f"### `{name}` × {project}",  # noqa: RUF001  (the document's own sign)
            "",
            "| release | " + " | ".join(version for version, _, _ in cells) + " |",
            "|---|" + "---|" * len(cells),
            f"| `{name}` | " + " | ".join(state for _, state, _ in cells) + " |",
            "",
        ]
        lines += [f"- {version}: {state}" + (f" — {reason}" if reason else "") for version, state, reason in cells]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
