"""The paths and names of before 0.2 keep working for one release, each with a
``DeprecationWarning`` that names its successor; nothing of the package itself uses them."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest

from tests.support.children import ROOT
from verl_npu_autopatch import authoring
from verl_npu_autopatch.authoring import Patch, Reach, Site, Target
from verl_npu_autopatch.engine import catalog


@pytest.mark.parametrize(("former", "kit"), [("spec", "spec"), ("patching", "patching"), ("handover", "handover")])
def test_a_former_module_path_re_exports_the_kit_and_names_its_successor(former: str, kit: str) -> None:
    sys.modules.pop(f"verl_npu_autopatch.{former}", None)
    with pytest.warns(DeprecationWarning, match=rf"verl_npu_autopatch\.authoring\.{kit}"):
        module = importlib.import_module(f"verl_npu_autopatch.{former}")
    successor = importlib.import_module(f"verl_npu_autopatch.authoring.{kit}")
    assert module.__all__ and all(getattr(module, name) is getattr(successor, name) for name in successor.__all__)


@pytest.mark.parametrize("former", ["spec", "patching", "handover"])
def test_a_former_module_path_is_the_kit_module_and_its_warning_points_at_the_importer(former: str) -> None:
    sys.modules.pop(f"verl_npu_autopatch.{former}", None)
    importer = compile(f"import verl_npu_autopatch.{former} as module", "plugin_importer.py", "exec")
    scope: dict[str, types.ModuleType] = {}
    with pytest.warns(DeprecationWarning, match=rf"^verl_npu_autopatch\.{former} moved to") as seen:
        exec(importer, scope)
    assert [(w.filename, w.lineno) for w in seen] == [("plugin_importer.py", 1)]  # the importer, as before
    kit = sys.modules[f"verl_npu_autopatch.authoring.{former}"]
    assert scope["module"] is sys.modules[f"verl_npu_autopatch.{former}"] is kit


def test_the_former_engine_module_names_resolve() -> None:
    from verl_npu_autopatch.engine import PatchError, activate, lifecycle, report

    assert (activate, report, PatchError) == (lifecycle.activate, lifecycle.report, lifecycle.PatchError)
    with pytest.raises(AttributeError):
        _ = importlib.import_module("verl_npu_autopatch.engine").no_such_name


def test_the_former_patch_keywords_build_a_reach_with_a_warning() -> None:
    target = (Target("m", "f"),)
    with pytest.warns(DeprecationWarning, match=r"copies= -> reach=Reach\(copies_in=...\)"):
        former = Patch("p.x", "s", target, lambda site: lambda: None, copies=("pkg",), triggers=target)
    assert former.reach == Reach(copies_in=("pkg",), triggers=target)
    assert former.hooks == target and former.defined_at.startswith("tests/unit/test_former_names.py:")
    with pytest.raises(ValueError, match="copies only"):
        Reach(stale_values=dict)


def test_site_engine_is_the_hand_over() -> None:
    handover = types.SimpleNamespace()
    site = Site(Patch("p.y", "s", (Target("m", "f"),), lambda s: lambda: None), Target("m", "f"), sys, sys, "f", None)
    assert site.engine is None and Site(*site) == site  # positional order unchanged
    assert site._replace(handover=handover).engine is handover


def test_no_built_in_family_uses_a_former_name() -> None:
    # in a fresh interpreter (this one has loaded the families already), every warning an error
    code = "from verl_npu_autopatch.engine import catalog; print(len(catalog.builtin()))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], env=env, capture_output=True)
    assert done.returncode == 0 and int(done.stdout) == len(catalog.builtin()) > 60, done.stderr
    assert "Reach" in authoring.__all__ and authoring.Reach is Reach
