"""``ascend.dsv4_rope_plain_swa``: DeepSeek-V4's sliding-window-only attention layers get a plain
RoPE table, as the reference model has, instead of vllm-ascend's YaRN-scaled one.

vllm-ascend's DeepSeek-V4 builds one ``ComplexExpRotaryEmbedding`` per attention layer: layers with
a KV compressor pass the RoPE groups ``["default", "c<ratio>"]`` and the compressed RoPE base, the
sliding-window-only ones (compress ratio <= 1) ``["default"]`` and the plain base. The embedding
computes its table with YaRN (``precompute_freqs_cis`` with the context window as the original
length) for both kinds; the reference applies YaRN on the compressed layers only, so the
sliding-window layers rotate queries and keys with interpolated frequencies (the recipe's
``vllm-ascend-rope-original-seq-len.patch``, which passes an original length of 0 for them and
returns the unscaled frequencies). From 0.29.0rc1 the embedding takes an ``apply_yarn_scaling``
keyword (DeepSeek-V4.1 passes it), but DeepSeek-V4's model still passes nothing (0.30.0rc2).

The fix wraps ``ComplexExpRotaryEmbedding.__init__``: a call with the groups ``["default"]`` alone
(or none) and no scaling keyword (``apply_yarn_scaling``, ``original_max_position_embeddings``,
the recipe's ``original_seq_len``) gets plain RoPE: the release's own ``apply_yarn_scaling=False``
where ``__init__`` reads that keyword (the table then has a key of its own), else, for that one
call, a ``precompute_freqs_cis`` returning the unscaled frequencies ``base ** (-2i / dim)``.
Calls that name a scaling, and the compressed layers, are left as they are. Releases without the
keyword key the table by base, not by scaling (as the recipe's fix does too): the two kinds keep
separate tables because DeepSeek-V4 gives them different bases (``rope_theta``,
``compress_rope_theta``). Opt-in (group ``dsv4``): only DeepSeek-V4 builds these layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import APPLY, RECIPE, Code, Site, Verdict, decides, unsupported, wrapping_patch

MODULE = "vllm_ascend.ops.rope_dsv4"
METHOD = "ComplexExpRotaryEmbedding.__init__"
PARAMS = (
    "self",
    "vllm_config",
    "layername",
    "head_size",
    "rotary_dim",
    "max_position_embeddings",
    "base",
    "scaling_factor",
    "rope_groups",
    "extra_kwargs",
)
#: The keyword of 0.29.0rc1 and later that turns YaRN off, and how ``__init__`` reads it (whitespace-free).
SWITCH = "apply_yarn_scaling"
READS_SWITCH = f'extra_kwargs.get("{SWITCH}"'
#: Keywords by which a caller already says how to scale.
SCALING_KEYWORDS = (SWITCH, "original_max_position_embeddings", "original_seq_len")
PRECOMPUTE = "self.precompute_freqs_cis("


@decides(f"{MODULE}:{METHOD}", PARAMS)
def rope_rule(init: Code) -> Verdict:
    if not init.has(PRECOMPUTE):
        return unsupported(f"{METHOD} computing its table with {PRECOMPUTE[:-1]}", "another table")
    return APPLY


def sliding_window_only(rope_groups: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a call builds a DeepSeek-V4 sliding-window-only layer's RoPE with no scaling named."""
    return rope_groups in (None, ["default"]) and not any(name in kwargs for name in SCALING_KEYWORDS)


def _plain_frequencies(torch: Any) -> Callable[..., Any]:
    """A ``precompute_freqs_cis`` returning the unscaled RoPE frequencies."""

    def precompute_freqs_cis(dim: int, seqlen: int, original_seq_len: int, base: float, *args: Any, **kw: Any) -> Any:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    return precompute_freqs_cis


def _wrap(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    switch = Code.live(site.value).has(READS_SWITCH)
    plain = _plain_frequencies(site.module.torch)

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, layername: str, *args: Any, **kwargs: Any) -> None:
        groups = args[5] if len(args) > 5 else kwargs.get("rope_groups")  # after head_size ... scaling_factor
        if not sliding_window_only(groups, kwargs):
            return original(self, vllm_config, layername, *args, **kwargs)
        if switch:
            return original(self, vllm_config, layername, *args, **kwargs, **{SWITCH: False})
        object.__setattr__(self, "precompute_freqs_cis", plain)  # this call only; nn.Module keeps __dict__
        try:
            original(self, vllm_config, layername, *args, **kwargs)
        finally:
            vars(self).pop("precompute_freqs_cis", None)
        return None

    return __init__


PATCHES = [
    wrapping_patch(
        "ascend.dsv4_rope_plain_swa",
        "DeepSeek-V4's sliding-window-only layers get plain RoPE, not YaRN-scaled frequencies.",
        rule=rope_rule,
        wrap=_wrap,
        opt_in="dsv4",
        reference=RECIPE,
    ),
]
