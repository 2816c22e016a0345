"""Round 4 of the fault matrix (issue 31), the engine's part: target modules executed again
(deleted and imported afresh, replaced in ``sys.modules`` while importing), the package's own
modules leaving ``sys.modules`` around the first watched import, and activation interrupted or out
of stack, in real child interpreters (venvs with the built wheel and the fixture packages).
``docs/reliability.md`` names each case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.children import ROOT, run_json

NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}


def test_deleted_and_reimported_target_is_patched_again(any_python: Path) -> None:
    # test-isolation fixtures and hot-reload tools: `del sys.modules[target]`, then import it again
    code = """
import json, sys, vllm.model, verl_npu_autopatch
old = vllm.model
del sys.modules["vllm.model"]
import vllm.model
r = verl_npu_autopatch.report()["fixture.forward"]
seen = [vllm.model is not old, vllm.model.Layer().forward(1), r.state, r.reason]
seen += [verl_npu_autopatch.revert("fixture.forward"), vllm.model.Layer().forward(1), old.Layer().forward(1)]
print(json.dumps(seen))
"""
    fresh, forward, state, reason, reverted, after, old = run_json(any_python, code, env=NPU)
    assert (fresh, forward, state, reverted, after, old) == (True, 12, "applied", ["fixture.forward"], 2, 2)
    assert reason.endswith("again after a fresh import (it had left sys.modules)")


def test_target_replacing_itself_in_sys_modules(any_python: Path) -> None:
    # the lazy-module idiom (transformers): the module puts another object in sys.modules
    code = """
import json, sys, vllm, autopatch_lazy, verl_npu_autopatch
r = verl_npu_autopatch.report()["fixture.lazy"]
seen = [type(autopatch_lazy).__name__, autopatch_lazy.Thing().hello(), r.state]
seen += [verl_npu_autopatch.revert("fixture.lazy"), autopatch_lazy.Thing().hello()]
print(json.dumps(seen))
"""
    seen = run_json(any_python, code, env={**NPU, "AUTOPATCH_FIXTURE_LAZY": "1"})
    assert seen == ["_Lazy", "patched:upstream", "applied", ["fixture.lazy"], "upstream"]


def test_first_watched_import_inside_mock_patch_dict(any_python: Path) -> None:
    # the package's own modules leave sys.modules with the block; its one engine and observer stay
    code = """
import json, sys
from unittest import mock
with mock.patch.dict(sys.modules):
    import vllm.model
    inside = vllm.model.Layer().forward(1)
import vllm, vllm.model, autopatch_target, verl_npu_autopatch
from verl_npu_autopatch.engine import lifecycle as engine
r = verl_npu_autopatch.report()
print(json.dumps([inside, vllm.model.Layer().forward(1), vllm.Engine().run(), autopatch_target.Thing().hello(),
                  r.status, r["fixture.forward"].state, r["fixture.early"].state,
                  engine.engine().observer is getattr(sys, "_verl_npu_autopatch_observer")]))
"""
    seen = run_json(any_python, code, env=NPU)
    assert seen == [12, 12, "patched:upstream", "patched:upstream", "active", "applied", "applied", True]


def test_interrupted_activate_keeps_its_live_fix(any_python: Path) -> None:
    # Ctrl-C inside activate() after one fix went in (targets imported before, without the
    # start-up hook), then activate() again: recorded applied, and revert() undoes it
    code = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "verl_npu_autopatch_placeholder", False)]
import vllm.model, autopatch_target, verl_npu_autopatch
try:
    verl_npu_autopatch.activate()
    first = "done"
except KeyboardInterrupt:
    first = "interrupted"
between = verl_npu_autopatch.report()
verl_npu_autopatch.activate()
r = verl_npu_autopatch.report()
seen = [first, between.status, between["fixture.forward"].state, r.status, r["fixture.forward"].state,
        r["fixture.early"].state, vllm.model.Layer().forward(1), autopatch_target.Thing().hello()]
verl_npu_autopatch.revert()
print(json.dumps(seen + [vllm.model.Layer().forward(1), autopatch_target.Thing().hello()]))
"""
    seen = run_json(any_python, code, env={**NPU, "AUTOPATCH_FIXTURE_FIX": "interrupt"})
    assert seen == [
        *["interrupted", "not-activated", "applied", "active", "applied", "applied"],
        *[12, "patched:upstream", 2, "upstream"],
    ]


def test_interrupted_trigger_fix_then_retried_import(any_python: Path) -> None:
    # Ctrl-C while the fix of the very package whose import activated goes in: that import
    # fails; the retry is patched
    code = """
import json
try:
    import vllm
    first = "imported"
except KeyboardInterrupt:
    first = "interrupted"
import vllm, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([first, vllm.Engine().run(), r.status, r["fixture.trigger"].state]))
"""
    seen = run_json(any_python, code, env={**NPU, "AUTOPATCH_FIXTURE_FIX": "interrupt-trigger"})
    assert seen == ["interrupted", "patched:upstream", "active", "applied"]


@pytest.mark.parametrize("later", ["submodule", "activate"])
def test_activation_out_of_stack_is_retried(any_python: Path, later: str) -> None:
    # a first watched import 150 frames deep under a recursion limit of 200 (it fits without us):
    # the import succeeds; a later, shallower import of a watched module (or activate()) activates
    code = f"""
import json, sys
sys.setrecursionlimit(200)
def deep(n):
    if n:
        return deep(n - 1)
    import vllm, vllm.old_layout  # a module of the package, as deep: no second try from there
    return vllm.Engine().run()
first = deep(150)
import verl_npu_autopatch
between = verl_npu_autopatch.report()
sys.setrecursionlimit(1000)
if {later!r} == "activate":
    verl_npu_autopatch.activate()
import vllm.model
r = verl_npu_autopatch.report()
print(json.dumps([first, between.status, "out of stack" in between.reason, vllm.model.Layer().forward(1),
                  vllm.Engine().run(), r.status, r["fixture.trigger"].state]))
"""
    seen = run_json(any_python, code, env=NPU)
    assert seen == ["upstream", "not-activated", True, 12, "patched:upstream", "active", "applied"]


def test_activation_out_of_stack_leaves_no_half_imported_package(any_python: Path) -> None:
    # activate() at every depth from the limit up: at some depth the stack runs out inside an import
    # activation makes (wrapt's of asyncio); the submodules that import left behind outlived their
    # package, so the retry and the user's own `import asyncio` raised NameError
    code = """
import json, sys
import verl_npu_autopatch
sys.setrecursionlimit(400)
def deep(n):
    if n:
        return deep(n - 1)
    verl_npu_autopatch.activate()
for depth in range(395, 150, -1):
    try:
        deep(depth)
    except RecursionError:
        continue
    if verl_npu_autopatch.report().status != "not-activated":
        break
sys.setrecursionlimit(1000)
import asyncio, vllm.model
r = verl_npu_autopatch.report()
print(json.dumps([callable(asyncio.run), vllm.model.Layer().forward(1), r.status, r.reason,
                  r["fixture.forward"].state]))
"""
    seen = run_json(any_python, code, env=NPU)
    assert seen == [True, 12, "active", "activated by api", "applied"]


def test_docs_name_every_case() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text()
    for name in [n for n in globals() if n.startswith("test_") and n != "test_docs_name_every_case"]:
        assert f"{name.removeprefix('test_')}`" in text, name
