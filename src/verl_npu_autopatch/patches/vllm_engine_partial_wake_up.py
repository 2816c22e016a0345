"""``vllm.engine_partial_wake_up``: backport of vLLM's partial wake-up fix (vLLM issue #44395,
PR #44483), opt-in with group ``glm52``.

After ``wake_up(tags=["weights"])`` the KV cache is still released, so ``EngineCore.wake_up``
must resume scheduling only once the executor is fully awake, and an idle data-parallel rank
(``DPEngineCoreProc``) must not run dummy forward passes while asleep. Both touch freed memory
otherwise. vLLM ≥ 0.30 has the fix (``fixed-upstream``).

The EngineCore process is reached by the start-up hook (the ``.pth``), which runs in every
interpreter, spawned ones included: no entry-point swapping is needed.

verl 0.9's ``patch_vllm_glm52_partial_wake_up`` is the same backport. Ours carries verl's
``_verl_vllm_ascend_glm52_patched`` marker on both methods, so verl run after us finds them patched
(and keeps vLLM's own ``run_engine_core``); installed by verl first, ours records ``yielded``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Patch,
    Reach,
    Site,
    StaticRule,
    Target,
    Undo,
    UpstreamTree,
    Verdict,
    chain,
    fixed_upstream,
    replace_method,
    signature_text,
    unsupported,
)
from verl_npu_autopatch.patches._verl import GLM52_MARKER, claim, yield_to_verl

CORE = "vllm.v1.engine.core"
WAKE_PARAMS = ("self", "tags")

#: Upstream fix in ``wake_up``: resume only when not sleeping (0.30: an ``if``; 0.32: a flag).
_WAKE_FIXED = re.compile(
    r"ifnotself\.model_executor\.is_sleeping:self\.resume_scheduler\(\)"
    r"|(\w+)=notself\.model_executor\.is_sleeping.{0,300}?if\1:self\.resume_scheduler\(\)"
)
#: Upstream fix in ``DPEngineCoreProc.run_busy_loop``: the dummy batch only when awake.
_DUMMY_FIXED = re.compile(r"notself\.model_executor\.is_sleeping:(?:with[^:]*:)?self\.execute_dummy_batch\(\)")
_DUMMY_BODY = "defexecute_dummy_batch(self):self.model_executor.execute_dummy_batch()"


def wake_up_state(wake_up: Code) -> str | Verdict:
    """``"fixed"`` (upstream or ours), ``"needed"``, or an ``unsupported`` verdict."""
    if wake_up.marker or (wake_up.source and _WAKE_FIXED.search(wake_up.source)):
        return "fixed"
    expected_body = (
        'tags=[tfortintagsift!="scheduling"]',
        "iftagsisNoneortags:self.model_executor.wake_up(tags)",
    )
    if (
        wake_up.params != WAKE_PARAMS
        or not wake_up.has(*expected_body)
        or not (wake_up.source or "").endswith("self.resume_scheduler()")
    ):
        return unsupported(
            "EngineCore.wake_up(self, tags) dropping 'scheduling', waking the executor, then "
            "ending with self.resume_scheduler()",
            f"wake_up{signature_text(wake_up.params)} with a different body",
        )
    return "needed"


def dummy_batch_state(execute_dummy_batch: Code | None, busy_loop: Code | None) -> str | Verdict:
    """``"fixed"`` (upstream or ours), ``"needed"``, or an ``unsupported`` verdict."""
    if execute_dummy_batch is not None and execute_dummy_batch.marker:
        return "fixed"
    if busy_loop is not None and busy_loop.source and _DUMMY_FIXED.search(busy_loop.source):
        return "fixed"
    if execute_dummy_batch is None or execute_dummy_batch.source != _DUMMY_BODY:
        return unsupported(
            "DPEngineCoreProc.execute_dummy_batch == 'self.model_executor.execute_dummy_batch()'",
            "a different execute_dummy_batch" if execute_dummy_batch else "none",
        )
    if busy_loop is None or not busy_loop.has("self.execute_dummy_batch()"):
        return unsupported("DPEngineCoreProc.run_busy_loop calling self.execute_dummy_batch()", "none")
    return "needed"


def partial_wake_up_rule(wake_up: Code, execute_dummy_batch: Code | None, busy_loop: Code | None) -> Verdict:
    """Decide on ``EngineCore.wake_up`` and ``DPEngineCoreProc``'s dummy-batch path together."""
    states = (wake_up_state(wake_up), dummy_batch_state(execute_dummy_batch, busy_loop))
    for state in states:
        if isinstance(state, Verdict):
            return state
    if states == ("fixed", "fixed") and not (wake_up.marker or (execute_dummy_batch and execute_dummy_batch.marker)):
        return fixed_upstream(
            "EngineCore.wake_up resumes scheduling only when the executor is awake and "
            "DPEngineCoreProc.run_busy_loop skips the dummy batch while asleep"
        )
    return APPLY


def _decorated(func: Any, name: str) -> Any:
    """The function named ``name`` that a decorator without ``functools.wraps`` closed over
    (vLLM 0.32 wraps ``run_busy_loop`` in a fault-tolerance closure); else ``func`` itself."""
    for _ in range(8):  # a few decorator layers at most
        inner = None
        for cell in getattr(func, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value) and getattr(value, "__name__", None) == name:
                inner = value
        if inner is None:
            break
        func = inner
    return func


def _live_parts(module: Any) -> tuple[Code | None, Code | None]:
    dp = getattr(module, "DPEngineCoreProc", None)
    dummy = getattr(dp, "execute_dummy_batch", None) if dp is not None else None
    loop = getattr(dp, "run_busy_loop", None) if dp is not None else None
    return (Code.live(dummy) if dummy else None), (Code.live(_decorated(loop, "run_busy_loop")) if loop else None)


def _dummy_batch(site: Site) -> Any:
    """The live ``DPEngineCoreProc.execute_dummy_batch`` (verl patches it with ``wake_up``)."""
    return getattr(getattr(site.module, "DPEngineCoreProc", None), "execute_dummy_batch", None)


def _check(site: Site) -> Verdict:
    return partial_wake_up_rule(Code.live(site.value), *_live_parts(site.module))


def _fix(site: Site) -> Undo:
    name = site.patch.name
    undos: list[Undo] = []
    if wake_up_state(Code.live(site.value)) == "needed":

        def make_wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def wake_up(self: Any, tags: list[str] | None = None) -> None:
                if tags is not None and "scheduling" in tags:
                    tags = [tag for tag in tags if tag != "scheduling"]
                if tags is None or tags:
                    self.model_executor.wake_up(tags)
                if not self.model_executor.is_sleeping:  # a partial wake-up keeps scheduling paused
                    self.resume_scheduler()

            return claim(wake_up, GLM52_MARKER)

        undos.append(replace_method(site.owner, site.attribute, make_wake_up, name))
    if dummy_batch_state(*_live_parts(site.module)) == "needed":

        def make_dummy(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def execute_dummy_batch(self: Any) -> Any:
                if self.model_executor.is_sleeping:  # idle DP rank while asleep: nothing is mapped
                    return None
                return original(self)

            return claim(execute_dummy_batch, GLM52_MARKER)

        undos.append(replace_method(site.module.DPEngineCoreProc, "execute_dummy_batch", make_dummy, name))
    return chain(*undos)


def _static(tree: UpstreamTree) -> Verdict:
    def rule(wake_up: Code) -> Verdict:
        dummy_batch = tree.code(CORE, "DPEngineCoreProc.execute_dummy_batch")
        return partial_wake_up_rule(wake_up, dummy_batch, tree.code(CORE, "DPEngineCoreProc.run_busy_loop"))

    return tree.judge(CORE, "EngineCore.wake_up", rule)


PATCHES = [
    Patch(
        name="vllm.engine_partial_wake_up",
        summary="EngineCore resumes scheduling only when fully awake; idle DP ranks skip dummy batches while asleep.",
        reference="https://github.com/vllm-project/vllm/issues/44395",
        groups=("glm52", "vllm"),
        targets=(Target.parse(f"{CORE}:EngineCore.wake_up"),),
        reach=Reach(secondary=(Target.parse(f"{CORE}:DPEngineCoreProc.execute_dummy_batch"),)),
        default=False,
        check=_check,
        fix=_fix,
        yields_to=(yield_to_verl(_dummy_batch),),
        static=StaticRule(_static, reads=("vllm/v1/engine/core.py",)),
    ),
]
