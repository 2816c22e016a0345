"""``ascend.310p_sampler_record_stream``: vllm-ascend's 310P sampler keeps its side-stream tensor
alive until the consuming stream is done with it (opt-in, group ``310p``: only Atlas 300I / 310P
cards sample through it).

``vllm_ascend._310p.sample.sampler:_random_sample_310p`` has the pattern ``random_sample`` had
before vllm-ascend PR #13394 (``ascend.sampler_record_stream``): a device tensor is made inside
``npu_stream_switch(global_stream())``, the current stream waits for the side stream and then
reads the tensor, and nothing records the tensor on the current stream. Its block is tied to the
side stream only, so once the function returns it can be handed out again on the side stream
while the current stream still reads it: sampled ids drawn from overwritten noise. Two shapes,
both without ``record_stream`` in every release read:

- 0.18.0 to 0.25.1rc1: ``q`` (exponential noise drawn on the CPU) copied to the device with
  ``q = q.npu()`` on the side stream, then ``probs.div_(q)``;
- 0.26.0rc1 on: ``uniforms`` from ``_generate_request_uniforms_310p`` (which ends in
  ``uniforms.to(device, non_blocking=True)``, a device copy made on the side stream), then
  ``_sample_from_cdf_310p(probs, uniforms)`` on the current stream.

The fix adds ``<tensor>.record_stream(torch.npu.current_stream())`` right after the wait, in the
release's own function (``_side_stream``, the transformation ``ascend.sampler_record_stream``
uses). A release recording the tensor itself is ``fixed-upstream``. ``forward_native`` calls the
function through the module global, so rebinding the module attribute reaches every caller.
"""

from __future__ import annotations

from verl_npu_autopatch.authoring import Code, Verdict, decides, unsupported, wrapping_patch
from verl_npu_autopatch.patches._side_stream import SWITCH, SideTensor, recording, side_stream_rule

SAMPLER = "vllm_ascend._310p.sample.sampler"
FUNCTION = "_random_sample_310p"
PARAMS = ("probs", "generators")
#: The helper the newer shape makes its tensor with, and the device copy it must end in.
UNIFORMS_HELPER = "_generate_request_uniforms_310p"
DEVICE_COPY = "returnuniforms.to(device,non_blocking=True)"
#: 0.18.0 to 0.25.1rc1: ``q`` drawn on the CPU, copied to the device on the side stream.
Q = SideTensor(
    "q",
    made=(f"{SWITCH}q=torch.empty_like(probs)", "q=q.npu()"),
    used="probs.div_(q)",
    words="copying q to the device on global_stream() and dividing probs by it after wait_stream",
)
#: 0.26.0rc1 on: one uniform per request, copied to the device on the side stream.
UNIFORMS = SideTensor(
    "uniforms",
    made=(f"{SWITCH}uniforms={UNIFORMS_HELPER}(",),
    used="_sample_from_cdf_310p(probs,uniforms)",
    words=f"making uniforms with {UNIFORMS_HELPER} on global_stream() and sampling from them after wait_stream",
)
SHAPES = (Q, UNIFORMS)


@decides(f"{SAMPLER}:{FUNCTION}", PARAMS, reading=(f"{SAMPLER}:{UNIFORMS_HELPER}",))
def sampler_310p_rule(code: Code, helper: Code | None) -> Verdict:
    verdict = side_stream_rule(code, FUNCTION, SHAPES)
    if verdict.action == "apply" and not Q.found(code) and (helper is None or not helper.has(DEVICE_COPY)):
        # uniforms is a device tensor made on the side stream only if the helper copies it there
        return unsupported(f"{UNIFORMS_HELPER} ending in uniforms.to(device, non_blocking=True)", "another helper")
    return verdict


PATCHES = [
    wrapping_patch(
        "ascend.310p_sampler_record_stream",
        "vllm-ascend's 310P sampler records its side-stream tensor (q, or uniforms) on the consuming stream.",
        rule=sampler_310p_rule,
        wrap=recording(SHAPES),
        opt_in="310p",
        reference="https://github.com/vllm-project/vllm-ascend/pull/13394",
    ),
]
