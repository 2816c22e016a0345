"""``ascend.dsv4_dummy_tid2eid``: DeepSeek-V4 starts with ``load_format=dummy`` (what RL rollouts
use before the first weight sync): its hash-routing table names distinct experts per token
(opt-in, group ``dsv4``).

vllm-ascend's ``DeepseekV4MoE.__init__`` gives each hash-routed layer (``layer_idx <
num_hash_layers``) a token-to-expert table ``gate.tid2eid`` of shape ``[vocab, top_k]``. Up to
0.27.1rc1 it is made with ``torch.zeros``: a real load overwrites it from the checkpoint, but the
dummy loader fills floating-point tensors only, so every token routes ``top_k`` times to expert 0.
MC2's dispatch/combine assume a token never picks one expert twice, and the profile run at
start-up fails (vllm-ascend issue #17197). 0.28.0rc1 builds the table as ``(token + j) %
n_routed_experts`` (vllm-ascend PR #16485): ``fixed-upstream``.

The fix wraps ``DeepseekV4MoE.__init__``: a table the release left all zeros is filled, in place,
with ``(token + j) % n_routed_experts`` (distinct ids per row whenever ``top_k <= n_routed_experts``).
A real load still overwrites it. The ``wo_a`` half of PR #16485 is not carried (CHANGELOG).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Target,
    UpstreamTree,
    Verdict,
    around,
    decides,
    fixed_upstream,
    module_file,
    unsupported,
    wrapping_patch,
)

#: Where the model lives: a package from 0.27.1rc1, a module before.
MODEL = "vllm_ascend.models.deepseek_v4.model"
FLAT = "vllm_ascend.models.deepseek_v4"
METHOD = "DeepseekV4MoE.__init__"
PARAMS = ("self", "config", "parallel_config", "quant_config", "prefix", "is_draft_layer")
#: What the rule looks for (whitespace-free).
TABLE = "self.gate.tid2eid=nn.Parameter("
ZEROS = f"{TABLE}torch.zeros("


@decides(f"{MODEL}:{METHOD}", PARAMS)
def tid2eid_rule(code: Code) -> Verdict:
    """``DeepseekV4MoE.__init__``: is the hash-routing table made of zeros?"""
    if code.has(ZEROS):
        return APPLY
    if code.has(TABLE):
        return fixed_upstream("DeepseekV4MoE.__init__ builds gate.tid2eid from something other than torch.zeros")
    return unsupported("DeepseekV4MoE.__init__ making gate.tid2eid as an nn.Parameter", "another __init__")


def static(tree: UpstreamTree) -> Verdict:
    """The rule on the release's module holding ``DeepseekV4MoE`` (the flat one before 0.27.1rc1)."""
    module = MODEL if tree.code(MODEL, METHOD) is not None or tree.code(FLAT, METHOD) is None else FLAT
    return tree.judge(module, METHOD, tid2eid_rule)


def distinct_experts(table: Any, experts: int) -> bool:
    """Fill ``table`` (``[tokens, top_k]``) in place with ``(token + j) % experts``, when it is an
    all-zero integer table and ``top_k <= experts``; whether it did."""
    import torch

    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.is_floating_point():
        return False
    tokens, top_k = table.shape
    if not 0 < top_k <= experts or bool(table.any()):
        return False
    with torch.no_grad():
        rows = torch.arange(tokens, device=table.device).unsqueeze(1)
        offsets = torch.arange(top_k, device=table.device).unsqueeze(0)
        table.copy_((rows + offsets) % experts)
    return True


def fill_table(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """The release's ``__init__``; a hash table it left all zeros then names distinct experts."""
    result = original(self, *args, **kwargs)
    table = getattr(getattr(self, "gate", None), "tid2eid", None)
    experts = getattr(self, "n_routed_experts", 0)
    if table is not None and isinstance(experts, int):
        distinct_experts(table, experts)
    return result


PATCHES = [
    dataclasses.replace(
        wrapping_patch(
            "ascend.dsv4_dummy_tid2eid",
            "DeepSeek-V4's hash-routing table names distinct experts per token under load_format=dummy.",
            rule=tid2eid_rule,
            wrap=around(fill_table),
            opt_in="dsv4",
            static=static,
            reads=(module_file(MODEL), module_file(FLAT)),
            reference="https://github.com/vllm-project/vllm-ascend/pull/16485",
        ),
        targets=(Target.parse(f"{MODEL}:{METHOD}"), Target.parse(f"{FLAT}:{METHOD}")),
    ),
]
