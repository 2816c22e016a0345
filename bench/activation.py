"""Inactive activation on a host without the NPU stack (``VERL_NPU_AUTOPATCH_DEVICE`` unset/auto).

Run it with the python of a venv where verl-npu-autopatch is installed and torch_npu is not:

    python3 bench/activation.py --python .envs/base-3.11-*/bin/python [--rounds 200]

Fresh processes, interleaved rounds:

1. In-process timer around ``from verl_npu_autopatch import engine; engine.activate()`` (import of
   the engine modules included: that is what the first watched import pays); and, for scale, the
   same with the engine module already imported (the decision alone).
2. Paired: ``import vllm`` of the test fixture package (``tests/fixtures/site``, a two-line module,
   NOT the real vLLM) with the package on (default), with ``VERL_NPU_AUTOPATCH=0``, and with the
   ``.pth`` line's placeholder taken off ``sys.meta_path`` first (as if the package were not
   installed, the baseline): the whole cost a process pays when the placeholder sees a watched
   import on a non-NPU host.

``--compare PYTHON`` adds the same two measures for another venv (e.g. one with the main branch's
wheel) in the same interleaved rounds, so a change's cost is read as a paired difference.
``--env NAME=VALUE`` sets a variable in every child (``VERL_NPU_AUTOPATCH_LOG=ERROR``: not plainly
inactive, so ``activation`` and the engine decide).

Each child also reports whether wrapt or importlib.metadata got imported (they must not be).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import FIXTURE_SITE, clean_env, interleave, report, spawn_timed, summary

ACTIVATE = """
import sys, time, json
t = time.perf_counter()
from verl_npu_autopatch import engine  # before 0.2 a module, now a package naming the same functions
engine.activate("bench")
dt = time.perf_counter() - t
print(json.dumps([dt, engine.report().status, "wrapt" in sys.modules, "importlib.metadata" in sys.modules]))
"""

DECIDE = """
import sys, time, json
from verl_npu_autopatch import engine  # before 0.2 a module, now a package naming the same functions
t = time.perf_counter()
engine.activate("bench")
dt = time.perf_counter() - t
print(json.dumps([dt, engine.report().status, "wrapt" in sys.modules, "importlib.metadata" in sys.modules]))
"""

IMPORT_VLLM = """
import sys, time, json
if UNHOOK:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "verl_npu_autopatch_placeholder", False)]
t = time.perf_counter()
import vllm
dt = time.perf_counter() - t
engine = sys.modules.get("verl_npu_autopatch.engine.lifecycle") or sys.modules.get("verl_npu_autopatch.engine")
status = engine.report().status if engine is not None else "-"
print(json.dumps([dt, status, "wrapt" in sys.modules, "importlib.metadata" in sys.modules]))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="python of a venv with the package, without torch_npu")
    parser.add_argument("--compare", help="python of another venv with another build of the package")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in every child (e.g. VERL_NPU_AUTOPATCH_LOG=ERROR: the host is decided inactive by the engine)",
    )
    args = parser.parse_args(argv)
    seen: dict[str, set] = {}
    extra = dict(item.split("=", 1) for item in args.env)

    def child(name: str, code: str, python: str = args.python, **env: str) -> float:
        out = spawn_timed([python, "-c", code], clean_env(PYTHONPATH=str(FIXTURE_SITE), **{**extra, **env}))[2]
        elapsed, status, wrapt, metadata = json.loads(out)
        seen.setdefault(name, set()).add(f"engine {status}, wrapt imported: {wrapt}, metadata imported: {metadata}")
        return elapsed

    hooked, unhooked = IMPORT_VLLM.replace("UNHOOK", "False"), IMPORT_VLLM.replace("UNHOOK", "True")
    for code in (ACTIVATE, hooked):  # warm the page cache
        child("warm", code)
    activating = {
        "import engine + activate()": functools.partial(child, "import engine + activate()", ACTIVATE),
        "activate() alone": functools.partial(child, "activate() alone", DECIDE),
    }
    importing = {
        "import vllm (fixture), package on": functools.partial(child, "on", hooked),
        "import vllm (fixture), VERL_NPU_AUTOPATCH=0": functools.partial(child, "off", hooked, VERL_NPU_AUTOPATCH="0"),
        "import vllm (fixture), placeholder removed": functools.partial(child, "unhooked", unhooked),
    }
    if args.compare:
        activating["compare: import engine + activate()"] = functools.partial(
            child, "compare: import engine + activate()", ACTIVATE, args.compare
        )
        importing["compare: import vllm (fixture), package on"] = functools.partial(
            child, "compare: on", hooked, args.compare
        )
    activation = interleave(activating, args.rounds)
    imports = interleave(importing, args.rounds)
    seen.pop("warm", None)
    report(
        "Inactive activation on a non-NPU host",
        {
            "in-process activation, fresh processes (ms)": summary(activation, "activate() alone", "ms", 1e3),
            "`import vllm` of the fixture package (ms)": summary(
                imports, "import vllm (fixture), placeholder removed", "ms", 1e3
            ),
        },
        {
            "python": args.python,
            "compare": args.compare or "-",
            "rounds": args.rounds,
            "children saw": {k: sorted(v) for k, v in seen.items()},
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
