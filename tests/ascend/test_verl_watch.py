"""verl's NPU runtime patch sites (``scripts/verl_sites.py``), read from real verl releases, against
the parity table of ``docs/verl.md``; a newer release with a site no row names fails ``--latest``."""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from tests.support import upstream

SYNTHETIC = '''"""A synthetic verl module: an NPU runtime patch of Megatron's P2P shape exchange."""
from megatron.core.pipeline_parallel import p2p_communication

from verl.utils.device import is_npu_available


def _communicate_shapes_npu(self, *args, **kwargs):
    return None


if is_npu_available:
    p2p_communication.P2PCommunicator._communicate_shapes = _communicate_shapes_npu
'''


@pytest.fixture(scope="module")
def script():
    return upstream.matrix_script()


def _release(script, version: str):
    return next(a for a in script.VERL.columns if a.version == version)


def test_every_site_of_the_table_release_is_in_the_parity_table(script):
    found = script.VERL.sites(_release(script, "0.9.1"))
    targets = {site.target for site in found}
    assert "tensordict.base.TensorDictBase._sync_all" in targets
    assert "vllm_ascend.device_allocator.camem.CaMemAllocator.sleep" in targets
    assert "device_operator.indexer_select_post_process" in targets  # a local receiver, verl's function
    assert len(found) == 41
    assert script.verl_sites.unlisted(found, script.parity_rows()) == []


def test_sites_the_table_does_not_name_are_found_in_a_real_release(script):
    """verl 0.8.0's A2 MC2 patches of vllm-ascend (gone in 0.9.0) are NPU sites no row names."""
    found = script.VERL.sites(_release(script, "0.8.0"))
    missing = {site.target for site in script.verl_sites.unlisted(found, script.parity_rows())}
    assert missing == {
        "vllm_ascend.ascend_forward_context.select_moe_comm_method",
        "vllm_ascend.ops.linear_op.SequenceRowParallelOp.matmul_and_reduce",
        "vllm_ascend.worker.model_runner_v1.NPUModelRunner._select_moe_comm_method",
    }


def _fake_verl(script, cache, version: str, extra: dict[str, str]) -> None:
    """A fake verl wheel ``version``: 0.9.1's Python files plus ``extra`` (path → source)."""
    base = _release(script, "0.9.1")
    files = cache / "files"
    files.mkdir(parents=True, exist_ok=True)
    script.download(base)
    root = script.verl_root(base)
    fake = files / f"verl-{version}-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as wheel:
        for path in sorted((root / "verl").rglob("*.py")):
            wheel.write(path, path.relative_to(root).as_posix())
        for name, text in extra.items():
            wheel.writestr(name, text)
    fake.with_name(fake.name + ".sha256").write_text(hashlib.sha256(fake.read_bytes()).hexdigest() + "\n")
    for suffix in ("", ".sha256"):
        target = files / (base.filename + suffix)
        if not target.exists():
            os.link(script.CACHE / "files" / (base.filename + suffix), target)


def test_a_newer_verl_release_with_a_new_site_fails_the_drift_watch(script, tmp_path, monkeypatch, capsys):
    _fake_verl(script, tmp_path, "9.9.8", {})
    _fake_verl(script, tmp_path, "9.9.9", {"verl/utils/megatron/p2p_npu_patch.py": SYNTHETIC})
    monkeypatch.setattr(script.fetch, "newer_versions", lambda project, than: ["9.9.8", "9.9.9"])
    monkeypatch.setattr(
        script.fetch,
        "index_artifact",
        lambda project, version, prefer: script.Artifact(project, version, f"verl-{version}-py3-none-any.whl"),
    )
    assert script.latest([script.VERL], tmp_path) == 1
    out = capsys.readouterr().out
    assert "verl: table's newest 0.9.1; newer on the index: 9.9.8, 9.9.9: 1 change(s)" in out
    assert (
        "verl 9.9.9: a new NPU runtime patch site, not in docs/verl.md's parity table: "
        "verl/utils/megatron/p2p_npu_patch.py:12: "
        "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate_shapes "
        "(under is_npu_available)"
    ) in out
    assert "verl 9.9.8" not in out


def test_what_counts_as_a_site(script):
    source = """
import torch
from vllm.layers import Layer
from verl.utils import helper


def patch_for_npu(module):
    thing = module.Thing
    def replacement(self):
        return None
    thing.forward = replacement        # a local receiver, a function verl defines: a site
    thing.count = 3                    # not a function: not a site
    self_like = object()


def unrelated(layer):
    Layer.forward = layer              # not under an NPU guard


if torch.npu.is_available():
    setattr(Layer, "forward", print)   # an import's attribute, by setattr: a site
    helper.value = 1                   # verl's own module: not a site
if input_ids is not None:
    Layer.extra = 1                    # "input_ids" is not an NPU guard
"""
    found = script.verl_sites.file_sites(source, "verl/x.py")
    assert [(s.target, s.guard) for s in found] == [
        ("thing.forward", "def patch_for_npu"),
        ("vllm.layers.Layer.forward", "torch.npu.is_available()"),
    ]
    assert script.verl_sites.npu_word("is_torch_npu_available") and not script.verl_sites.npu_word("input_ids")


def test_a_site_is_listed_only_by_a_row_naming_it_exactly(script):
    """A row naming the attribute alone lists no new site of the same name; each of verl 0.9.1's
    rotary sites and qwen2_5_vl's RMSNorm is listed by its own model's row."""
    rows, site = script.parity_rows(), script.verl_sites.Site
    npu_patch, vllm_patch = "verl/models/transformers/npu_patch.py", "verl/utils/vllm/npu_vllm_patch.py"
    omni = site(npu_patch, "transformers.models.qwen3_omni.modeling_qwen3_omni.apply_rotary_pos_emb", "", 1, "")
    wake_up = site(vllm_patch, "vllm_ascend.worker.worker.NPUWorker.wake_up", "wake_up", 1, "")
    assert script.verl_sites.unlisted([omni, wake_up], rows) == [omni, wake_up]
    found = {s.target: script.verl_sites.row_of(s, rows) for s in script.VERL.sites(_release(script, "0.9.1"))}
    rotary = {t.split(".")[2]: row for t, row in found.items() if t.endswith(".apply_rotary_pos_emb")}
    assert rotary == {
        "qwen2": 10,
        "qwen3": 12,
        "qwen3_moe": 13,
        "qwen3_vl_moe": 15,
        "qwen3_next": 16,
        "qwen3_5": 17,
        "qwen3_5_moe": 18,
    }
    assert found["transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2RMSNorm.forward"] == 11
