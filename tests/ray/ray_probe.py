"""Worker-side helpers for the Ray tests, imported inside Ray workers (their directory is put on
``PYTHONPATH`` through the runtime_env's ``env_vars``) and in their multiprocessing children.

Module level uses the standard library only: nothing here may import ``verl_npu_autopatch`` or
a watched package before :func:`startup` has looked at what the interpreter's start-up did.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any


def _start_up_hook(finder: Any) -> bool:
    """The ``.pth`` line's placeholder, or the observer that takes its place."""
    return bool(
        getattr(finder, "verl_npu_autopatch_observer", False)
        or getattr(finder, "verl_npu_autopatch_placeholder", False)
    )


def startup() -> dict[str, Any]:
    """What this interpreter's start-up left behind, read without importing the package."""
    spec = importlib.util.find_spec("verl_npu_autopatch")
    package_file = spec.origin if spec is not None else None
    direct_url = None
    if package_file is not None:
        from importlib import metadata

        direct_url = json.loads(metadata.distribution("verl-npu-autopatch").read_text("direct_url.json") or "null")
    return {
        "pid": os.getpid(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "hooks": [
            "observer" if getattr(f, "verl_npu_autopatch_observer", False) else "placeholder"
            for f in sys.meta_path
            if _start_up_hook(f)
        ],
        "startup_loaded": "_verl_npu_autopatch_startup" in sys.modules,
        "package_file": package_file,
        "installed_from": (direct_url or {}).get("url"),
        "pytest_findable": importlib.util.find_spec("pytest") is not None,
        "environ": {k: v for k, v in os.environ.items() if k.startswith("VERL_NPU_AUTOPATCH")},
    }


def watched_import() -> dict[str, Any]:
    """:func:`startup`, then import the fixture ``vllm.model`` and report what the engine did."""
    before = startup()
    import autopatch_probe

    seen = autopatch_probe.observe()
    import verl_npu_autopatch

    return {"startup": before, "device": verl_npu_autopatch.report().device, **seen}


def watched_import_into(queue: Any) -> None:
    """Multiprocessing target: :func:`watched_import` in a child, sent back as JSON."""
    queue.put(json.dumps(watched_import()))


class SpawningActor:
    """Does what vLLM does inside a Ray actor: imports the (fixture) vLLM, then starts a
    multiprocessing ``spawn`` child, which is a fresh interpreter."""

    def __init__(self) -> None:
        self.at_start = startup()

    def run(self) -> dict[str, Any]:
        import multiprocessing

        here = watched_import()
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=watched_import_into, args=(queue,))
        child.start()
        seen = json.loads(queue.get(timeout=120))
        child.join(60)
        return {"actor_start": self.at_start, "actor": here, "child": seen, "child_exitcode": child.exitcode}
