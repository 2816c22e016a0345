"""Variant fallback in a private in-process engine: every variant present rejected by its check."""

from __future__ import annotations

import sys
import types

import pytest

from verl_npu_autopatch.authoring.spec import Patch, Target, unsupported
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine


def test_every_variant_rejected_is_unsupported_with_each_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("autopatch_variants_target")

    class Layer:
        def forward(self) -> str:
            return "upstream"

        def legacy(self) -> str:
            return "upstream"

    module.Layer = Layer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    fixes: list[str] = []
    patch = Patch(
        "test.rejected",
        "Both variants fail their check.",
        (Target(module.__name__, "Layer.forward"), Target(module.__name__, "Layer.legacy")),
        fix=lambda site: fixes.append(str(site.target)) or (lambda: None),
        check=lambda site: unsupported(f"{site.target}: a newer body", f"{site.attribute}()"),
        device="any",
    )
    engine = Engine([patch], Config(device="npu"))
    engine.activate("test")
    record = engine.records["test.rejected"]
    assert record.state == "unsupported" and fixes == []
    assert record.reason == (
        "expected autopatch_variants_target:Layer.forward: a newer body; found forward() | "
        "expected autopatch_variants_target:Layer.legacy: a newer body; found legacy()"
    )
