"""``vllm.rotary_flash_attn_guard`` on the real ``ApplyRotaryEmb``.

An NPU host is emulated for the one module global the upstream ``__init__`` consults
(``common.current_platform``: not CPU) and a MindSpeed-style dummy ``flash_attn`` is put on
``sys.path``: a single-file module, not a package. The patch's static check is held against the
live behaviour of the installed class: it must say ``fixed-upstream`` exactly when the unpatched
class survives the dummy, and ``apply`` exactly when it crashes.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Iterator
from contextlib import suppress
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.vllm_support import record
from verl_npu_autopatch.authoring.patching import MARKER
from verl_npu_autopatch.authoring.spec import Site
from verl_npu_autopatch.patches import vllm_rotary_flash_attn_guard

PATCH = vllm_rotary_flash_attn_guard.PATCHES[0]
NAME = "vllm.rotary_flash_attn_guard"
#: The fix without its check: applies whatever the installed vLLM looks like.
FORCED = dataclasses.replace(PATCH, check=None)


@pytest.fixture(autouse=True)
def _config(vllm_config: Any) -> None:
    """CustomOp construction reads the current vLLM config."""


@pytest.fixture
def common() -> Any:
    from vllm.model_executor.layers.rotary_embedding import common

    return common


class _NotCpu:
    """The real platform, except that it is not the CPU one (as NPUPlatform is not)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture
def npu_host(common: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Non-CPU platform for ``common`` plus a dummy single-file ``flash_attn`` module on sys.path."""
    platform = getattr(common, "current_platform", None)
    if platform is not None:
        monkeypatch.setattr(common, "current_platform", _NotCpu(platform))
    (tmp_path / "flash_attn.py").write_text('"""Dummy flash_attn, as MindSpeed installs it."""\nDUMMY = True\n')
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert find_spec("flash_attn") is not None  # found, like MindSpeed's dummy
    yield tmp_path
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


def _construct(common: Any, **kwargs: Any) -> tuple[Any, BaseException | None]:
    try:
        return common.ApplyRotaryEmb(**kwargs), None
    except Exception as exc:
        return None, exc


def test_dummy_flash_attn_is_a_module_not_a_package(npu_host: Path) -> None:
    """The premise: importing below the dummy raises ModuleNotFoundError ("not a package")."""
    with pytest.raises(ModuleNotFoundError, match="not a package"):
        import_module("flash_attn.ops.triton.rotary")
    with suppress(ModuleNotFoundError):
        import_module("flash_attn.ops.triton.rotary")  # what a guarded upstream does: swallowed


def test_check_agrees_with_the_live_upstream_behaviour(npu_host: Path, common: Any, apply: Any) -> None:
    obj, error = _construct(common, enforce_enable=True)
    engine = apply(PATCH)
    rec = record(engine, NAME)
    print(f"\nunpatched ApplyRotaryEmb with a dummy flash_attn: {error!r}; patch: {rec.state}")
    if error is None:
        # The installed vLLM already copes with the dummy: the fast path is off, nothing lost.
        assert obj.apply_rotary_emb_flash_attn is None
        assert obj._enforce_enable is True
        assert "flash_attn" in sys.modules  # it did try the import, and swallowed the error
        assert rec.state == "fixed-upstream", rec
        assert "ModuleNotFoundError" in rec.reason
        assert MARKER not in common.ApplyRotaryEmb.__dict__["__init__"].__dict__
    else:
        # The installed vLLM crashes on the dummy: the patch must be applied, and then it works.
        assert isinstance(error, ModuleNotFoundError) and "flash_attn.ops" in str(error)
        assert rec.state == "applied", rec
        del sys.modules["flash_attn"]
        obj, error = _construct(common, enforce_enable=True)
        assert error is None and obj.apply_rotary_emb_flash_attn is None


def test_patched_init_never_imports_flash_attn(npu_host: Path, common: Any, apply: Any) -> None:
    unpatched, _ = _construct(common)
    tried = "flash_attn" in sys.modules
    sys.modules.pop("flash_attn", None)
    engine = apply(FORCED)
    assert record(engine, NAME).state == "applied"
    obj, error = _construct(common, enforce_enable=False, is_neox_style=False, enable_fp32_compute=True)
    assert error is None, error
    assert "flash_attn" not in sys.modules  # no import attempted at all
    assert obj.apply_rotary_emb_flash_attn is None
    assert (obj.is_neox_style, obj.enable_fp32_compute) == (False, True)
    # Upstream without the fix does try the import on a non-CPU platform (or crashes on it).
    assert tried or unpatched is None


@pytest.mark.parametrize("positional", [False, True], ids=["keywords", "positional"])
def test_enforce_enable_and_every_argument_reach_the_object(
    common: Any, apply: Any, monkeypatch: pytest.MonkeyPatch, positional: bool
) -> None:
    from vllm.model_executor.custom_op import CustomOp

    seen: list[dict[str, Any]] = []
    base_init = CustomOp.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append({"args": args, "kwargs": kwargs})
        base_init(self, *args, **kwargs)

    monkeypatch.setattr(CustomOp, "__init__", spy)
    arguments = dict(enforce_enable=True, is_neox_style=False, enable_fp32_compute=True)

    def build() -> Any:
        if positional:
            return common.ApplyRotaryEmb(*arguments.values())
        return common.ApplyRotaryEmb(**arguments)

    upstream = build()  # CPU platform here: upstream skips/needs no flash_attn either way
    apply(FORCED)
    patched = build()
    assert len(seen) == 2
    assert seen[1]["args"] + tuple(seen[1]["kwargs"].values()) == (True,)  # enforce_enable, nothing else
    for attribute in ("_enforce_enable", "is_neox_style", "enable_fp32_compute", "apply_rotary_emb_flash_attn"):
        assert getattr(patched, attribute) == getattr(upstream, attribute), attribute
    assert patched._enforce_enable is True
    assert patched._forward_method.__name__ == upstream._forward_method.__name__
    default = common.ApplyRotaryEmb()
    assert (default._enforce_enable, default.is_neox_style, default.enable_fp32_compute) == (False, True, False)


def test_subclass_calling_super_gets_the_patched_init(npu_host: Path, common: Any, apply: Any) -> None:
    """vllm-ascend's AscendApplyRotaryEmb subclasses and calls the base ``__init__``."""
    apply(FORCED)

    class NpuRotary(common.ApplyRotaryEmb):
        def __init__(self, enforce_enable: bool = False, is_neox_style: bool = True) -> None:
            super().__init__(enforce_enable=enforce_enable, is_neox_style=is_neox_style)

    obj = NpuRotary(enforce_enable=True, is_neox_style=False)
    assert "flash_attn" not in sys.modules
    assert (obj._enforce_enable, obj.is_neox_style, obj.apply_rotary_emb_flash_attn) == (True, False, None)


def test_replacement_keeps_metadata_and_reverts(common: Any, apply: Any) -> None:
    original = common.ApplyRotaryEmb.__dict__["__init__"]
    engine = apply(FORCED)
    patched = common.ApplyRotaryEmb.__dict__["__init__"]
    assert patched.__wrapped__ is original
    assert getattr(patched, MARKER) == NAME
    assert (patched.__qualname__, patched.__module__) == (original.__qualname__, original.__module__)
    assert inspect.signature(patched) == inspect.signature(original)
    assert engine.revert(NAME) == [NAME]
    assert common.ApplyRotaryEmb.__dict__["__init__"] is original


# ---------------------------------------------------------------- the check on other bodies
# Stand-ins written here in the shapes the research notes describe for other vLLM releases.


class _Base:
    def __init__(self, enforce_enable: bool = False) -> None:
        self._enforce_enable = enforce_enable


class FindSpecStyle(_Base):  # vLLM 0.13 - 0.18: unguarded import when find_spec finds it
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False):
        super().__init__(enforce_enable)
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute
        self.apply_rotary_emb_flash_attn = None
        if find_spec("flash_attn") is not None:
            from flash_attn.ops.triton.rotary import apply_rotary

            self.apply_rotary_emb_flash_attn = apply_rotary


class PlatformStyle(_Base):  # vLLM 0.23: skipped on CPU only, still unguarded on NPU
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False):
        super().__init__(enforce_enable=enforce_enable)
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute
        self.apply_rotary_emb_flash_attn = None
        if find_spec("flash_attn") is not None and not _NotCpu(None).is_cpu():
            from flash_attn.ops.triton.rotary import apply_rotary

            self.apply_rotary_emb_flash_attn = apply_rotary


class TryStyle(_Base):  # guarded by try/except ImportError
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False):
        super().__init__(enforce_enable=enforce_enable)
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute
        try:
            self.apply_rotary_emb_flash_attn = import_module("flash_attn.ops.triton.rotary").apply_rotary
        except ImportError:
            self.apply_rotary_emb_flash_attn = None


class HandlerOnlyStyle(_Base):  # the import sits in the handler, which nothing guards
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False):
        super().__init__(enforce_enable=enforce_enable)
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute
        try:
            self.apply_rotary_emb_flash_attn = None
        except ValueError:
            from flash_attn.ops.triton.rotary import apply_rotary

            self.apply_rotary_emb_flash_attn = apply_rotary


class ExtraStateStyle(_Base):  # upstream grew state the replacement would drop
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False):
        super().__init__(enforce_enable)
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute
        self.rotary_cache = {}
        if find_spec("flash_attn") is not None:
            from flash_attn.ops.triton.rotary import apply_rotary

            self.apply_rotary_emb_flash_attn = apply_rotary


class NoImportStyle(_Base):  # the fast path was removed upstream
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False):
        super().__init__(enforce_enable=enforce_enable)
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute


class MissingAssignmentStyle(_Base):  # a known argument no longer stored
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False):
        super().__init__(enforce_enable)
        self.is_neox_style = is_neox_style
        self.apply_rotary_emb_flash_attn = None
        if find_spec("flash_attn") is not None:
            from flash_attn.ops.triton.rotary import apply_rotary

            self.apply_rotary_emb_flash_attn = apply_rotary


class NewSignatureStyle(_Base):  # a changed signature
    def __init__(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False, *, dtype=None):
        super().__init__(enforce_enable)


@pytest.mark.parametrize(
    ("cls", "action", "words"),
    [
        (FindSpecStyle, "apply", ""),
        (PlatformStyle, "apply", ""),
        (HandlerOnlyStyle, "apply", ""),
        (TryStyle, "fixed-upstream", "guards"),
        (NoImportStyle, "fixed-upstream", "no longer imports"),
        (ExtraStateStyle, "unsupported", "self.rotary_cache = {}"),
        (MissingAssignmentStyle, "unsupported", "only "),
        (NewSignatureStyle, "unsupported", "*, dtype=None"),
    ],
)
def test_check_on_other_bodies(cls: type, action: str, words: str) -> None:
    site = Site(PATCH, PATCH.targets[0], sys.modules[__name__], cls, "__init__", cls.__dict__["__init__"])
    verdict = PATCH.check(site)
    assert verdict.action == action, verdict
    assert words in verdict.reason
