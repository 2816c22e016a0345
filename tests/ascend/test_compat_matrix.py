"""``docs/compatibility.md`` is what ``scripts/compat-matrix`` computes from the real releases."""

from __future__ import annotations

import dataclasses

import pytest

from tests.support import upstream
from verl_npu_autopatch.patches import ascend_routed_experts_capture


@pytest.fixture(scope="module")
def tables(releases) -> dict:
    """Every section, computed by the script's own download/extract code (cached)."""
    return upstream.matrix_script().compute()


def test_committed_table_is_current(tables):
    script = upstream.matrix_script()
    committed = script.DOC.read_text(encoding="utf-8")
    runtime = script.compute_runtime()  # the tensordict / torch_npu / megatron-core / verl section
    document = script.render(tables) + script.render_runtime(runtime) + script.VERL.render()
    assert document == committed, "stale: run python3 scripts/compat-matrix --write"
    rows = tables[script.ASCEND.title]

    cells = {name: {label: state for label, (state, _) in row.items()} for name, _, row in rows}
    assert (
        cells["ascend.rms_norm_residual"]["0.23.0"] == cells["ascend.rms_norm_residual"]["0.23.0.post1"] == ("applies")
    )
    assert cells["ascend.camem_sleep_sync"]["0.30.0rc2"] == "fixed-upstream"
    assert cells["ascend.camem_sleep_sync"]["0.23.0"] == "applies"
    indexer = cells["ascend.sfa_indexer_scale"]
    assert [indexer[v] for v in ("0.18.0", "0.21.0rc1", "0.23.0", "0.30.0rc2")] == [
        "unsupported",
        "applies",
        "applies",
        "applies",  # the 0.30 variant: attention/indexer.py still passes unscaled weights
    ]
    # 0.24 - 0.27: attention/indexer.py is a placeholder, sfa_v1 still unscaled; 0.28+: the backend
    lines = ("0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1")
    assert {indexer[v] for v in lines} == {"applies"}
    camem = cells["ascend.camem_sleep_sync"]
    assert [camem[v] for v in lines] == ["applies"] * 3 + ["fixed-upstream"] * 3  # 0.27.1rc1 syncs itself
    capture = cells["ascend.routed_experts_capture"]  # decided from the code: no module before 0.21.0rc1
    assert [capture[v] for v in ("0.13.0", "0.18.0", "0.21.0rc1", "0.25.1rc1")] == [
        "unsupported",
        "unsupported",
        "applies",
        "fixed-upstream",
    ]
    sampler = cells["ascend.sampler_record_stream"]
    assert [sampler[v] for v in ("0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1")] == [
        "applies"
    ] * 4 + ["fixed-upstream"]
    gate_fp32 = cells["ascend.gate_fp32_in_place"]
    assert [gate_fp32[v] for v in ("0.23.0", "0.27.1rc1", "0.28.0rc1")] == ["applies", "applies", "fixed-upstream"]
    reasons = {name: {label: reason for label, (_, reason) in row.items()} for name, _, row in rows}
    assert "patch_routed_experts_capturer" in reasons["ascend.routed_experts_capture"]["0.18.0"]
    assert "rl_config.enabled" in reasons["ascend.sfa_keep_kv_b_proj"]["0.30.0rc2"]
    assert cells["vllm.engine_partial_wake_up"]["0.30.0rc2"] == "fixed-upstream"


def test_gate_uses_the_patch_requirements():
    script = upstream.matrix_script()
    patch = dataclasses.replace(ascend_routed_experts_capture.PATCHES[0], requires=("vllm-ascend>=0.21.0rc1",))
    reason = script.gate(patch, {"vllm-ascend": "0.20.2rc1"})
    assert reason == "needs vllm-ascend>=0.21.0rc1; found vllm-ascend 0.20.2rc1"
    assert script.gate(patch, {"vllm-ascend": "0.21.0rc1"}) is None


def test_every_section_is_computed_from_real_releases(tables):
    script = upstream.matrix_script()
    cell = {
        (title, name): {label: state for label, (state, _) in cells.items()}
        for title, rows in tables.items()
        for name, _, cells in rows
    }
    vllm = script.VLLM.title
    assert list(cell[(vllm, "vllm.moe_weight_loader")]) == list(script.VLLM_VERSIONS)
    rotary = cell[(vllm, "vllm.rotary_flash_attn_guard")]
    assert rotary["0.23.0"] == "applies" and rotary["0.33.0"] == rotary["0.34.0"] == "fixed-upstream"
    assert cell[(vllm, "vllm.moe_weight_loader")]["0.34.0"] == "applies"
    hf = script.TRANSFORMERS.title
    # 4.57.6: Qwen3VLMoeTextExperts.forward(hidden_states, routing_weights, router_indices) fails the probe
    assert cell[(hf, "transformers.qwen3_vl_moe.experts")]["5.24.0"] == "applies"
    kernels = {states["5.25.0"] for (title, name), states in cell.items() if title == hf and "deepstack" not in name}
    assert kernels == {"applies"}
    deepstack = cell[(hf, "transformers.qwen3_vl.deepstack_clone")]  # transformers#41535, in 5.0
    assert deepstack == {"4.57.6": "applies", **dict.fromkeys(("5.9.0", "5.24.0", "5.25.0"), "fixed-upstream")}
    assert cell[(hf, "transformers.qwen3_5_moe.experts")]["4.57.6"] == "absent"  # no such family yet
    assert cell[(hf, "transformers.qwen2_5_vl.rms_norm")]["4.57.6"] == "applies"  # qwen2's, imported
    liger = script.LIGER.title
    assert cell[(liger, "apply_liger_kernel_to_qwen3")]["0.8.5"] == "agrees"
    # liger 0.8.0-0.8.4 take a rope switch for Qwen3-Next but rebind no rotary function
    assert cell[(liger, "apply_liger_kernel_to_qwen3_next")]["0.8.4"] == "differs"


def test_liger_replacements_follow_switches_and_conditions():
    import ast

    script = upstream.matrix_script()
    source = """
def apply_liger_kernel_to_x(rope=True, swiglu=False, model=None):
    if rope:
        modeling_x.apply_rotary_pos_emb = f
    if swiglu:
        if IS_V5:
            modeling_x.XExperts = g
        else:
            modeling_x.XMLP = h
    if model is not None:
        if swiglu:
            modeling_x.Ignored = i
    if rope:
        raise NotImplementedError("no rope here")
"""
    (function,) = ast.parse(source).body
    assert script.liger_replacements(function) == {
        "rope": ["apply_rotary_pos_emb", "!raises NotImplementedError"],
        "swiglu": ["XExperts [IS_V5]", "XMLP [not IS_V5]"],
    }


def _fake_release(script, cache, base, source, version: str, edit=lambda name, data: data) -> None:
    """A fake release ``version`` of ``base.project`` in ``cache``: the files the rules read, taken
    from the real release ``source`` and passed through ``edit``; ``base`` (the section's newest
    column, already downloaded by ``tables``) is linked in for the comparison."""
    import hashlib
    import io
    import os
    import tarfile
    import zipfile

    files = cache / "files"
    files.mkdir(parents=True, exist_ok=True)
    script.download(base)
    for suffix in ("", ".sha256"):
        if not (files / (base.filename + suffix)).exists():
            os.link(script.CACHE / "files" / (base.filename + suffix), files / (base.filename + suffix))
    package = {"vllm": "vllm", "megatron-core": "megatron", "torch": "torch"}[base.project]
    names = script.read_files(package)
    root = script.extract(source, names)
    stem = f"{base.project.replace('-', '_')}-{version}"
    fake = files / (f"{stem}.tar.gz" if source.sdist else f"{stem}-py3-none-any.whl")
    if source.sdist:
        with tarfile.open(fake, "w:gz") as tar:
            for name in names:
                data = edit(name, (root / name).read_bytes())
                info = tarfile.TarInfo(f"{stem}/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    else:
        with zipfile.ZipFile(fake, "w") as wheel:
            for name in names:
                if (root / name).is_file():
                    wheel.writestr(name, edit(name, (root / name).read_bytes()))
    fake.with_name(fake.name + ".sha256").write_text(hashlib.sha256(fake.read_bytes()).hexdigest() + "\n")


def _rename_weight_loader(name: str, data: bytes) -> bytes:
    """``RoutedExperts.weight_loader`` renamed: the MoE patch's target disappears."""
    if name.endswith("fused_moe/routed_experts.py"):
        assert b"def weight_loader(" in data
        return data.replace(b"def weight_loader(", b"def load_expert_weight(")
    return data


def _fake_index(script, monkeypatch, newer: list[str], suffix: str) -> None:
    """The index answers ``newer`` as the releases after every section's newest column, each a
    file named like the fakes of :func:`_fake_release`."""
    monkeypatch.setattr(script.fetch, "newer_versions", lambda project, than: list(newer))
    monkeypatch.setattr(
        script.fetch,
        "index_artifact",
        lambda project, version, prefer: script.Artifact(
            project, version, f"{project.replace('-', '_')}-{version}{suffix}"
        ),
    )


def test_latest_checks_every_newer_release_and_names_the_changed_cell(tables, tmp_path, monkeypatch, capsys):
    script = upstream.matrix_script()  # `tables`: the real newest column is downloaded (cached)
    newest = script.VLLM.columns[-1]
    _fake_release(script, tmp_path, newest, newest, "9.9.8")  # the same code: no change
    _fake_release(script, tmp_path, newest, newest, "9.9.9", _rename_weight_loader)
    _fake_index(script, monkeypatch, ["9.9.8", "9.9.9"], ".tar.gz")
    assert script.latest([script.VLLM], tmp_path) == 1
    out = capsys.readouterr().out
    assert "vllm: table's newest 0.34.0; newer on the index: 9.9.8, 9.9.9: 1 change(s)" in out
    assert "vLLM 0.34.0 -> 9.9.9: `vllm.moe_weight_loader`: applies -> unsupported" in out
    assert "-> 9.9.8" not in out  # checked, unchanged
    assert "rotary" not in out and "engine_partial_wake_up" not in out  # unchanged cells stay quiet


def test_latest_watches_the_runtime_projects_as_sections(tables, tmp_path, monkeypatch, capsys):
    """megatron-core is watched like vLLM: a "newer" release carrying 0.16.1's GPTModel._postprocess
    (before the upstream fix) turns the newest column's fixed-upstream into applies."""
    script = upstream.matrix_script()
    (megatron,) = [s for s in script.WATCHED if s.project == "megatron-core"]
    old = next(a for a in megatron.columns if a.version == "0.16.1")
    _fake_release(script, tmp_path, megatron.columns[-1], old, "9.9.9")
    _fake_index(script, monkeypatch, ["9.9.9"], "-py3-none-any.whl")
    assert script.latest([megatron], tmp_path) == 1
    out = capsys.readouterr().out
    assert "megatron-core 0.19.2 -> 9.9.9: `megatron.mtp_postprocess`: fixed-upstream -> applies" in out


def _default_the_format(name: str, data: bytes) -> bytes:
    """torch's ``_write_item`` giving ``serialization_format`` a default: nothing left to fix."""
    if name.endswith("checkpoint/filesystem.py"):
        required = b"    serialization_format: SerializationFormat,\n) -> WriteResult:"
        assert required in data
        return data.replace(required, required.replace(b",\n", b" = SerializationFormat.TORCH_SAVE,\n"))
    return data


def test_latest_watches_torch_for_the_patches_that_read_its_code(tables, tmp_path, monkeypatch, capsys):
    """A "newer" torch whose ``_write_item`` defaults the argument changes torch's cell of
    ``megatron.async_save_format``; the same code (9.9.8) changes nothing."""
    script = upstream.matrix_script()
    (torch,) = [s for s in script.WATCHED if s.project == "torch"]
    newest = torch.columns[-1]
    _fake_release(script, tmp_path, newest, newest, "9.9.8")
    _fake_release(script, tmp_path, newest, newest, "9.9.9", _default_the_format)
    _fake_index(script, monkeypatch, ["9.9.8", "9.9.9"], "-py3-none-any.whl")
    assert script.latest([torch], tmp_path) == 1
    out = capsys.readouterr().out
    assert f"torch: table's newest {newest.version}; newer on the index: 9.9.8, 9.9.9: 1 change(s)" in out
    assert (
        f"torch {newest.version} -> 9.9.9: `megatron.async_save_format`: applies -> fixed-upstream"
        " (torch's _write_item gives serialization_format a default)"
    ) in out


def test_every_section_is_watched():
    script = upstream.matrix_script()
    projects = [s.project for s in script.WATCHED]
    assert projects == [
        "vllm-ascend",
        "vllm",
        "transformers",
        "liger-kernel",
        "tensordict",
        "torch-npu",
        "megatron-core",
        "megatron-bridge",  # installs under megatron-core's ``megatron``: its own rows, its own releases
        "verl",  # fixes to verl's own code
        "torch",  # the torch side of the patches whose check reads torch's code
        "verl",  # verl's NPU runtime patch sites
    ]
    assert all(s.columns for s in script.WATCHED)
    # every rule over another project's code (``StaticRule.also``) is decided in that project's section
    also = {f.split("/")[0] for p in script.static_patches() for rule in p.static.also for f in rule.reads}
    assert also == {"torch"} and also <= set(script.runtime_sections.RUNTIME_PACKAGES.values())


def test_a_rule_file_belongs_to_the_project_of_the_longest_folder_holding_it():
    """Megatron-Bridge's ``megatron/bridge`` lies inside megatron-core's ``megatron``: a rule reading a
    Bridge file is decided on Bridge's releases, never on megatron-core's."""
    runtime = upstream.matrix_script().runtime_sections
    assert runtime.project_of("megatron/bridge/models/conversion/param_mapping.py") == "megatron-bridge"
    assert runtime.project_of("megatron/core/transformer/transformer_layer.py") == "megatron-core"
    assert runtime.project_of("megatron/bridge_like.py") == "megatron-core"  # a folder, not a name prefix
    assert runtime.project_of("torch_npu/utils/x.py") == "torch-npu" and runtime.project_of("vllm/x.py") is None
    core, bridge = runtime.runtime_files("megatron-core"), runtime.runtime_files("megatron-bridge")
    assert core and not {f for f in core if f.startswith("megatron/bridge/")}
    assert set(bridge) == {f for f in runtime.read_files("megatron") if f.startswith("megatron/bridge/")}


def test_newer_versions_are_every_release_after_the_column(monkeypatch):
    script = upstream.matrix_script()
    versions = ["0.9.1", "0.10.0rc1", "0.8.0", "0.10.0", "0.10.1.dev3", "0.9.2"]
    monkeypatch.setattr(script.fetch, "index_json", lambda project: {"versions": versions})
    assert script.newer_versions("x", "0.9.1") == ["0.9.2", "0.10.0rc1", "0.10.0"]


def test_a_newer_release_without_a_readable_file_fails_the_watch(monkeypatch, capsys):
    script = upstream.matrix_script()
    monkeypatch.setattr(script.fetch, "newer_versions", lambda project, than: ["9.9.9"])
    monkeypatch.setattr(script.fetch, "index_json", lambda project: {"files": [], "versions": ["9.9.9"]})
    (torch_npu,) = [s for s in script.WATCHED if s.project == "torch-npu"]
    assert script.latest([torch_npu]) == 1
    assert "torch-npu 9.9.9: cannot be read: no readable file of torch-npu 9.9.9 on the index" in (
        capsys.readouterr().out
    )


def test_latest_is_quiet_when_no_release_is_newer_than_the_table(monkeypatch, capsys):
    script = upstream.matrix_script()
    monkeypatch.setattr(script.fetch, "newer_versions", lambda project, than: [])
    assert script.latest([script.VLLM]) == 0
    assert "newer on the index: none: no change" in capsys.readouterr().out


def test_runtime_fix_rows_decide_from_the_real_release_sources():
    script = upstream.matrix_script()
    rows = script.compute_runtime()
    cells = {name: {version: state for version, state, _ in row} for project, name, row in rows if project != "torch"}
    sync = cells["tensordict.npu_sync"]
    assert [sync[v] for v in ("0.8.0", "0.8.3", "0.9.1")] == ["applies"] * 3
    assert sync["0.10.0"] == sync["0.15.3"] == "fixed-upstream"  # 0.15 moved _sync_all into a mixin
    nested = cells["torch_npu.nested_tensor_intercept"]
    assert [nested[v] for v in ("2.1.0.post17", "2.5.1.post1", "2.6.0.post5")] == ["applies"] * 3
    assert {nested[v] for v in ("2.7.1.post11", "2.9.1", "2.12.0.post3", "2.13.0", "2.14.0")} == {"fixed-upstream"}
    mtp = cells["megatron.mtp_postprocess"]
    assert [mtp[v] for v in ("0.15.3", "0.16.0", "0.16.1", "0.17.0rc0", "0.17.0", "0.19.2")] == [
        "unsupported",
        "applies",
        "applies",
        "fixed-upstream",
        "fixed-upstream",
        "fixed-upstream",
    ]
    torch = {name: {version: state for version, state, _ in row} for project, name, row in rows if project == "torch"}
    assert torch["megatron.async_save_format"] == {
        "2.7.1": "fixed-upstream",  # no serialization_format yet
        "2.8.0": "applies",
        "2.13.0": "applies",
        "2.15.0": "applies",
    }
    assert set(torch["torch_npu.nested_tensor_intercept"].values()) == {"fixed-upstream"}  # torch's own functions
    assert set(torch) == {"megatron.async_save_format", "torch_npu.nested_tensor_intercept"}
