"""What the ``.pth`` line costs, piece by piece: ``site.main()`` in one venv with the package,
the ``verl_npu_autopatch.pth`` file's content swapped between variants, paired against no file.

    python3 bench/pth_content.py --python .envs/base-3.11-*/bin/python [--rounds 120]

The file is restored afterwards. Variants: none; a comment only (the cost of site reading one
``.pth`` file); ``import os`` (an import line that loads nothing new); a line that puts a
do-nothing lambda finder on ``sys.meta_path`` (the floor of any line that installs a finder); a
bare import of the start-up module; the line shipped before, which imported it behind a guard;
the placeholder line with a guard that kept one placeholder although a venv runs the line twice;
the placeholder line with the watched names in a set (before); the same line written by hand, the
watched names in declaration order (before); and the shipped line (rendered by ``pth_line``), which
puts a placeholder there each time and imports nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import ROOT, clean_env, interleave, purelib, report, run, summary

SITE_MAIN = "import os, time; import site; t = time.perf_counter(); site.main(); print(time.perf_counter() - t)"
SHIPPED = (ROOT / "verl_npu_autopatch.pth").read_text()
#: The line shipped before the placeholder (0.1.0 after the start-up split): it imported the
#: start-up module at every interpreter start, inside a guard for a stale ``.pth``.
IMPORTING_LINE = (
    "import sys; '_verl_npu_autopatch_startup' in sys.modules or exec('try:\\n import _verl_npu_autopatch_startup"
    " as s\\nexcept Exception:\\n pass\\nelse:\\n s.install_observer()')\n"
)
#: The placeholder line with a guard against the second ``.pth`` pass of a venv (no placeholder
#: when the first finder already is one): compiling the guard cost more than it saved.
GUARD = "hasattr(sys.meta_path[:1] and sys.meta_path[0], 'verl_npu_autopatch_placeholder') or "
GUARDED_PLACEHOLDER_LINE = SHIPPED.replace("import sys; ", "import sys; " + GUARD, 1)
#: The placeholder line shipped until 2026-12-03: the watched names in a set, and a stale
#: start-up module emptied it.
SET_LINE = (
    "import sys; sys.meta_path.insert(0, type(sys.implementation)(verl_npu_autopatch_placeholder=True, "
    "find_spec=lambda n, *a, w=set('vllm vllm_ascend transformers liger_kernel verl tensordict torch_npu "
    "megatron'.split()), r=[]: exec('try: from _verl_npu_autopatch_startup import take_over as t; "
    "r.append(t(n, *a))\\nexcept Exception: r.append(w.clear())') or r.pop() if n in w else None))\n"
)
#: The placeholder line shipped until the line was rendered from ``WATCHED`` (``pth_line``): the
#: same line with the watched names in their declaration order instead of sorted.
WRITTEN_LINE = (
    "import sys; sys.meta_path.insert(0, type(sys.implementation)(verl_npu_autopatch_placeholder=True, "
    "find_spec=lambda n, *a, w='vllm vllm_ascend transformers liger_kernel verl tensordict torch_npu megatron', "
    "r=[]: exec('r.append(None)\\nif n in w.split():\\n try: from _verl_npu_autopatch_startup import take_over "
    "as t; r[-1] = t(n, *a)\\n except Exception: pass') or r.pop() if n in w else None))\n"
)
VARIANTS = {
    "no .pth": None,
    "comment only": "# a .pth file with nothing to run\n",
    "import os": "import os\n",
    "a do-nothing lambda finder": (
        "import sys; sys.meta_path.insert(0, type(sys.implementation)(find_spec=lambda *a: None))\n"
    ),
    "bare import of the start-up module": (
        "import _verl_npu_autopatch_startup; _verl_npu_autopatch_startup.install_observer()\n"
    ),
    "the importing line (before)": IMPORTING_LINE,
    "the placeholder line with a guard (before)": GUARDED_PLACEHOLDER_LINE,
    "the set-lookup line (before)": SET_LINE,
    "the written line (before)": WRITTEN_LINE,
    "shipped line (the placeholder, rendered)": SHIPPED,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="a venv's python with the package installed")
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    pth = purelib(args.python) / "verl_npu_autopatch.pth"
    original = pth.read_text()
    env = clean_env()

    def variant(content: str | None):
        def measure() -> float:
            if content is None:
                pth.unlink(missing_ok=True)
            else:
                pth.write_text(content)
            return float(run([args.python, "-S", "-c", SITE_MAIN], env=env))

        return measure

    try:
        samples = interleave({name: variant(text) for name, text in VARIANTS.items()}, args.rounds)
    finally:
        pth.write_text(original)
    rows = summary(samples, "no .pth", "ms", 1e3)
    report("The .pth line, piece by piece: site.main()", {"site.main() (ms)": rows}, {"rounds": args.rounds}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
