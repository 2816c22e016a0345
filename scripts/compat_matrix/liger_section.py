"""The Liger-Kernel section: what each ``apply_liger_kernel_to_<family>`` rebinds under each
switch, read with ``ast``, against the switch our arbitration hands each kernel over for.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from compat_matrix.fetch import Artifact, extract
from compat_matrix.table import Cell, Rows, Section

# ----------------------------------------------------------------------------- section: Liger-Kernel
LIGER_VERSIONS = ("0.8.0", "0.8.1", "0.8.2", "0.8.3", "0.8.4", "0.8.5")
LIGER_FILE = "liger_kernel/transformers/monkey_patch.py"


def liger_replacements(function: ast.FunctionDef) -> dict[str, list[str]]:
    """Switch (``rope``, ``rms_norm``, ``swiglu`` …) → the modeling-module names an
    ``apply_liger_kernel_to_*`` rebinds under ``if <switch>:``, each with the other conditions it
    sits under (``IS_TRANSFORMERS_V5_OR_LATER`` …) in brackets; ``!raises X`` when the switch
    raises instead (Liger 0.8.5: ``rope=True`` for Qwen3.5)."""
    params = {a.arg for a in (*function.args.args, *function.args.kwonlyargs)}
    found: dict[str, list[str]] = {}

    def visit(nodes: list[ast.stmt], switch: str | None, conditions: tuple[str, ...]) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                test = node.test
                if isinstance(test, ast.Name) and test.id in params:
                    visit(node.body, test.id, conditions)
                    visit(node.orelse, switch, conditions)
                else:
                    text = ast.unparse(test)
                    visit(node.body, switch, (*conditions, text))
                    visit(node.orelse, switch, (*conditions, f"not {text}"))
            elif isinstance(node, ast.Assign) and switch:
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, (ast.Name, ast.Attribute)):
                        owner = ast.unparse(target.value).split(".")
                        name = ".".join([*owner[1:], target.attr]) if owner[0].startswith("modeling_") else None
                        if name and not conditions_only_model(conditions):
                            tag = [c for c in conditions if "model" not in c.split()]
                            found.setdefault(switch, []).append(name + (f" [{', '.join(tag)}]" if tag else ""))
            elif isinstance(node, ast.Raise) and switch and not conditions_only_model(conditions):
                error = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                found.setdefault(switch, []).append(f"!raises {ast.unparse(error) if error else 'again'}")
            elif isinstance(node, (ast.For, ast.With, ast.Try)):
                visit(getattr(node, "body", []), switch, conditions)

    visit(function.body, None, ())
    return found


def conditions_only_model(conditions: tuple[str, ...]) -> bool:
    """Rebinding done only for a passed model instance (``if model is not None``)."""
    return any(c == "model is not None" for c in conditions)


def liger_cell(family: str, module: Any) -> Cell:
    """What ``apply_liger_kernel_to_<family>`` replaces, against ``liger.LIGER_SWITCH`` (which of
    our patches the arbitration hands over for each switch)."""
    from verl_npu_autopatch.patches import liger_arbitration as liger
    from verl_npu_autopatch.patches import transformers_npu

    function = module.function_node(f"apply_liger_kernel_to_{family}") if module else None
    if function is None:
        return "absent", f"no apply_liger_kernel_to_{family}"
    replaced = liger_replacements(function)
    params = {a.arg for a in (*function.args.args, *function.args.kwonlyargs)}
    taken = {
        s: {n.split(" ")[0].split(".")[0] for n in names if not n.startswith("!")} for s, names in replaced.items()
    }
    problems = []
    for kind, variants in transformers_npu.MODELS[family]:
        owners = {q.split(".")[0] for q in variants}
        switch = liger.LIGER_SWITCH.get(kind)
        takers = sorted(s for s, names in taken.items() if owners & names)
        if switch and switch in params and switch not in takers:
            problems.append(f"{kind}: our arbitration hands it over for {switch}=True, which does not rebind it")
        extra = [s for s in takers if s != switch]
        if extra:
            problems.append(f"{kind}: also rebound under {', '.join(extra)}")
    summary = "; ".join(f"{s} → {', '.join(n.lstrip('!') for n in names)}" for s, names in sorted(replaced.items()))
    return ("differs" if problems else "agrees"), "; ".join([summary, *problems])


def _liger_tree(artifact: Artifact, cache: Path) -> Any:
    from verl_npu_autopatch.authoring.fingerprints import UpstreamTree

    return UpstreamTree((extract(artifact, (LIGER_FILE,), cache),), {"liger-kernel": artifact.version})


def _liger_rows(trees: dict[str, Any]) -> Rows:
    from verl_npu_autopatch.patches import transformers_npu

    module_name = LIGER_FILE[: -len(".py")].replace("/", ".")
    return [
        (
            f"apply_liger_kernel_to_{family}",
            "",
            {label: liger_cell(family, tree.module(module_name)) for label, tree in trees.items()},
        )
        for family in transformers_npu.MODELS
    ]


LIGER = Section(
    title="Liger-Kernel arbitration",
    project="liger-kernel",
    intro=(
        "Which modeling-module names each `apply_liger_kernel_to_<family>` rebinds under each switch",
        "(read from the real `monkey_patch.py` with `ast`; instance patches for a passed `model` are",
        "not listed), checked against `patches/liger_arbitration.py` `LIGER_SWITCH`, the switch for which our",
        "arbitration hands each kernel over (`rms_norm` → RMSNorm, `swiglu` → MLP and experts, `rope` →",
        "rotary). Proven by running: on liger-kernel 0.8.5 (the `hf` env, transformers 5.24.0)",
        "`tests/hf/test_table_matches_live_checks.py` calls every function with `rope`, `rms_norm` and",
        "`swiglu` on and asserts it rebinds exactly the names listed (the transformers-5 branch). Those",
        "of qwen2_5_vl and qwen3_vl fail there importing their Liger model module (an ImportError in",
        "liger-kernel 0.8.5 with transformers 5.24.0), and qwen3_5 / qwen3_5_moe raise for `rope=True`.",
    ),
    columns=tuple(Artifact("liger-kernel", v, f"liger_kernel-{v}-py3-none-any.whl") for v in LIGER_VERSIONS),
    tree=_liger_tree,
    rows_of=_liger_rows,
    states=(
        "States: **agrees** (every switch our arbitration relies on rebinds our target, and nothing else",
        "of ours is rebound), **differs** (the reason names the kernel), **absent** (no such function).",
    ),
    prefer=("py3-none-any.whl",),
)
