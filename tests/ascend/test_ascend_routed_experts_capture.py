"""``ascend.routed_experts_capture`` with the releases' real ``patch/worker`` files.

``vllm_ascend.patch.worker`` is a stand-in module whose ``__file__`` is the release's real
``patch/worker/__init__.py`` (what the check reads) and whose ``__path__`` holds the release's
real ``patch_routed_experts_capture.py``, which the fix imports for real against the installed
vLLM (its one vllm-ascend import, ``ascend_forward_context``, is a stub). A
``vllm_ascend-<version>.dist-info`` written to a temporary directory on ``sys.path`` makes the
package look installed, with the release's version or a stale one (the patch decides from the code).
"""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.engine import environment
from verl_npu_autopatch.patches import ascend_routed_experts_capture

STATE = "ascend.routed_experts_capture"


@contextmanager
def stand_in(root: Path, version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vllm-ascend's release at ``root`` installed as ``version`` (the worker stand-in and its
    capture module, as the module docstring says), over the vLLM capturer module ``sys.modules``
    holds now (the installed vLLM's, or a release's a test put there); ``capture`` restored after."""
    capturer = importlib.import_module(ascend_routed_experts_capture.CAPTURER).RoutedExpertsCapturer
    info = tmp_path / "site" / f"vllm_ascend-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n")
    package = tmp_path / "worker"
    package.mkdir()
    shipped = root / "vllm_ascend/patch/worker/patch_routed_experts_capture.py"
    if shipped.is_file():  # releases before 0.21.0rc1 do not ship it
        shutil.copy(shipped, package)
    worker = doubles.stub_module(ascend_routed_experts_capture.WORKER, "stand-in for vllm_ascend.patch.worker")
    worker.__file__, worker.__path__ = str(root / "vllm_ascend/patch/worker/__init__.py"), [str(package)]
    context = doubles.stub_module(
        "vllm_ascend.ascend_forward_context", _EXTRA_CTX=None, MoECommType=type("MoECommType", (), {})
    )
    capture_before = capturer.__dict__["capture"]
    sys.path.insert(0, str(tmp_path / "site"))
    monkeypatch.setattr(environment, "_versions", {})
    try:
        with doubles.modules({ascend_routed_experts_capture.WORKER: worker, context.__name__: context}):
            yield
    finally:
        sys.path.remove(str(tmp_path / "site"))
        sys.modules.pop(ascend_routed_experts_capture.CAPTURE, None)
        capturer.capture = capture_before


@release_loaders.loads(
    ascend_routed_experts_capture,
    "vllm-ascend",
    ("0.23.0",),
    sites={"0.23.0": {f"{ascend_routed_experts_capture.CAPTURER}:RoutedExpertsCapturer.capture"}},
    param=True,
)
@pytest.fixture
def release(request, releases, npu, tmp_path, monkeypatch) -> Iterator[Path]:
    """Make vllm-ascend ``request.param`` look installed; yield its source root. The version
    look-ups start from an empty cache for the test and get the process's back afterwards."""
    label, version = request.param if isinstance(request.param, tuple) else (request.param, request.param)
    root = releases[label][0]
    with stand_in(root, version, tmp_path, monkeypatch):
        yield root


def test_gated_without_vllm_ascend_installed():
    record = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[
        STATE
    ]
    assert record.state == "gated"
    assert "vllm-ascend" in record.reason or "vllm_ascend" in record.reason


@pytest.mark.parametrize("release", ["0.23.0"], indirect=True)
def test_loads_the_release_capture_where_it_is_not_imported(release):
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    original = RoutedExpertsCapturer.__dict__["capture"]
    engine = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    record = engine.report()[STATE]
    assert record.state == "applied", record.reason
    assert RoutedExpertsCapturer.capture.__module__ == ascend_routed_experts_capture.CAPTURE
    assert Path(RoutedExpertsCapturer.capture.__code__.co_filename).name == "patch_routed_experts_capture.py"
    assert engine.revert() == [STATE]
    assert RoutedExpertsCapturer.__dict__["capture"] is original


@pytest.mark.parametrize("release", ["0.23.0"], indirect=True)
def test_the_record_follows_the_capture_not_the_trigger(release):
    """The patch is hooked on the worker package (its trigger) but fixes vLLM's class: a capture
    replaced after the fix is ``superseded``, and after ``revert()`` (the capture module stays
    imported) a new engine applies again instead of taking vLLM's capture for vllm-ascend's."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    original = RoutedExpertsCapturer.__dict__["capture"]
    engine = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    ours = RoutedExpertsCapturer.__dict__["capture"]
    RoutedExpertsCapturer.capture = lambda self, layer_id, topk_ids: None
    assert engine.report()[STATE].state == "superseded"
    RoutedExpertsCapturer.capture = ours
    assert engine.report()[STATE].state == "applied"
    engine.revert()
    assert RoutedExpertsCapturer.__dict__["capture"] is original
    again = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert again.report()[STATE].state == "applied", again.report()[STATE].reason
    assert again.revert() == [STATE]


@pytest.mark.parametrize("release", ["0.30.0rc2"], indirect=True)
def test_fixed_upstream_where_the_release_imports_it(release):
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    original = RoutedExpertsCapturer.__dict__["capture"]
    record = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[
        STATE
    ]
    assert record.state == "fixed-upstream"
    assert "unconditionally" in record.reason
    assert RoutedExpertsCapturer.__dict__["capture"] is original


@pytest.mark.parametrize("release", [("0.23.0", "0.19.1rc2.dev1265")], indirect=True)
def test_a_stale_version_string_does_not_decide(release):
    """0.23.0's code reporting an old development version (as Ascend images do) is still patched."""
    record = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[
        STATE
    ]
    assert record.state == "applied", record.reason


@pytest.mark.parametrize("release", [("0.30.0rc2", "0.19.1rc2.dev1265")], indirect=True)
def test_fixed_upstream_code_under_a_stale_version_string(release):
    record = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[
        STATE
    ]
    assert record.state == "fixed-upstream"


@pytest.mark.parametrize("release", [("0.18.0", "0.30.0rc2")], indirect=True)
def test_unsupported_where_the_release_ships_no_capture_module(release):
    """0.18.0's code (no patch_routed_experts_capture) under a newer version string."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    original = RoutedExpertsCapturer.__dict__["capture"]
    record = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[
        STATE
    ]
    assert record.state == "unsupported"
    assert "no such module" in record.reason
    assert RoutedExpertsCapturer.__dict__["capture"] is original
