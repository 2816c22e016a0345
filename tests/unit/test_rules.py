"""Every family's pure rule on literal inputs: the decision a check (live) and the compatibility
table (a release's source) share, without any upstream package. Sources are written as
``Code`` holds them: whitespace removed."""

from __future__ import annotations

import ast
import textwrap
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from verl_npu_autopatch.authoring.fingerprints import Code, ModuleSource, UpstreamTree, definition_defaults
from verl_npu_autopatch.authoring.patching import parameter_defaults
from verl_npu_autopatch.authoring.spec import Verdict
from verl_npu_autopatch.patches import (
    ascend_310p_sampler_record_stream,
    ascend_attention_buffers_keep_mapped,
    ascend_camem_sleep_sync,
    ascend_dispatcher_expert_ids_sleep,
    ascend_dsv4_dummy_tid2eid,
    ascend_dsv4_dummy_wo_a,
    ascend_dsv4_rope_plain_swa,
    ascend_fused_moe_copies,
    ascend_mooncake_aborted_receive,
    ascend_mooncake_hybrid_send_counts,
    ascend_mooncake_sleep_reregister,
    ascend_mooncake_truncate_rehash,
    ascend_mxfp8_reload_in_place,
    ascend_routed_experts_capture,
    ascend_sampler_record_stream,
    ascend_wake_expert_layout,
    liger_arbitration,
    megatron_async_save_format,
    megatron_bridge_mindspeed_te,
    megatron_expert_bias_fp32,
    megatron_layer_offset,
    megatron_mtp_postprocess,
    tensordict_npu_sync,
    torch_npu_nested_tensor_intercept,
    transformers_deepstack,
    verl_3d_position_ids,
    verl_checkpoint_send_reoffload,
    verl_defer_duplicates,
    verl_distillation_log_prob_floor,
    verl_hccl_broadcast_thread,
    verl_npu_version_probe,
    vllm_engine_partial_wake_up,
    vllm_moe,
    vllm_rotary_flash_attn_guard,
    vllm_routed_experts_padding_slots,
)
from verl_npu_autopatch.patches._capture_trim import trim_rule
from verl_npu_autopatch.patches.ascend_glm52 import rules as glm52_rules

SLEEP = ("self", "offload_tags")
UNMAP = "forptrinself.pointer_to_data:unmap_and_release(handle)"
FLOAT16 = "def__init__(self,config,module):"
F16_PARAMS = ("self", "config", "module")
ESTIMATOR = "defcompute_distillation_loss_reverse_kl_estimator(config,distillation_config,model_output,data):"
ESTIMATOR_PARAMS = ("config", "distillation_config", "model_output", "data")
UNFLOORED = (
    's=no_padding_2_padding(model_output["log_probs"],data)t=no_padding_2_padding(data["teacher_logprobs"],data)'
    "l=kl_penalty(logprob=student_log_probs,ref_logprob=teacher_log_probs)"
)
PROBE = "defget_npu_versions():result=subprocess.run("
UPDATE = 'asyncdefupdate_weights(self,global_steps=None,mode="auto"):ifeffective_mode!="naive":'
SEND = (
    "per_tensor_param,_=self.actor.engine.get_per_tensor_param()"
    "awaitself.checkpoint_engine.send_weights(per_tensor_param)"
)
NAIVE = 'awaitself.rollout.update_weights(p)ifself.actor.engine.is_param_offload_enabled:self.actor.engine.to("cpu")'
hccl = verl_hccl_broadcast_thread
INIT = "def__init__(self,rank:int,process_group:StatelessProcessGroup|str,bucket:torch.Tensor)->None:"
STORED = "".join(hccl.ASSIGNED)
HCCL = hccl.PARAMS
AWAITS_TASK = Code("asyncdefwait_for_complete(self):awaitself._taskreturnself.metadata", ("self",))
RETURNS_AT_ONCE = Code("asyncdefwait_for_complete(self):returnself.metadata", ("self",))
bridge = megatron_bridge_mindspeed_te
#: Megatron-Bridge 0.3.0's _detect_parallelism_type, whitespace-free and cut down to what the rule reads.
DETECT = (
    "def_detect_parallelism_type(self,module:nn.Module)->str:module_type=type(module).__name__"
    'ifmodule_type=="TELayerNormColumnParallelLinear":ifself.megatron_paramand('
    'self.megatron_param.endswith("layer_norm_weight")):return"replicated"return"column"'
    "forparallelism,typesinself._MODULE_TYPE_REGISTRY.items():ifmodule_typeintypes:returnparallelism"
    'ifmodule_type=="TELinear":returnmodule.parallel_mode'
)
#: 0.5.0's: the fused class matched by a substring constant of the class.
DETECT_05 = DETECT.replace(
    'module_type=="TELayerNormColumnParallelLinear"', "self._FUSED_LAYER_NORM_COLUMN_PARALLEL_SUBSTRINGinmodule_type"
)
SUBSTRING = {"_FUSED_LAYER_NORM_COLUMN_PARALLEL_SUBSTRING": "LayerNormColumnParallelLinear"}
TE_REGISTRY = {
    "column": {"TEColumnParallelLinear", "TELayerNormColumnParallelLinear", "TEColumnParallelGroupedLinear"},
    "row": {"TERowParallelLinear", "TERowParallelGroupedLinear"},
    "replicated": {"LayerNorm", "RMSNorm", "TEDotProductAttention"},
}
#: A registry naming every MindSpeed class but the fused one (MindSpeedTELinear by its usual mode).
ALL_BUT_FUSED = {k: v | {n for n, te in bridge.COUNTERPARTS.items() if te in v} for k, v in TE_REGISTRY.items()}
ALL_BUT_FUSED["column"] |= {"MindSpeedTELinear"}
DETECTION = ("self", "module")
POSTPROCESS = "def_postprocess(self,hidden_states,labels):"
SYNC_09 = "def_sync_all(self):ifself._has_cuda:torch.cuda.synchronize()elifself._has_mps:torch.mps.synchronize()"
WAKE = (
    'defwake_up(self,tags=None):iftagsisnotNoneand"scheduling"intags:tags=[tfortintagsift!="scheduling"]'
    "iftagsisNoneortags:self.model_executor.wake_up(tags)self.resume_scheduler()"
)
DUMMY = "defexecute_dummy_batch(self):self.model_executor.execute_dummy_batch()"
LOOP = "defrun_busy_loop(self):whileTrue:self.execute_dummy_batch()"
CAPTURE = Code("defcapture(self,layer_id,topk_ids):...", ("self", "layer_id", "topk_ids"))
POST = ("sfa_impl", "q_li", "q_li_scale", "q_li_shape_ori", "weights")
IMPL = "weights=kw[:,self.head_dim:]DeviceOperator.indexer_select_post_process(self,q,s,shape,weights)"
OWN_ROWS = "if n == token_num_per_dp:\n    pass\n"
DEEPSTACK = ("self", "hidden_states", "visual_pos_masks", "visual_embeds")
#: The samplers (``random_sample`` and the 310P one) as the releases write them.
SAMPLE = ("probs", "generators")
SIDE_Q = "withnpu_stream_switch(global_stream()):q=torch.empty_like(probs)q.exponential_()"
SIDE_Q_310P = "withnpu_stream_switch(global_stream()):q=torch.empty_like(probs).cpu()_fill(q,generators)q=q.npu()"
SIDE_UNIFORMS = (
    "withnpu_stream_switch(global_stream()):uniforms=_generate_request_uniforms_310p(probs.shape[0],generators,"
    "probs.device,)"
)
WAITED = "torch.npu.current_stream().wait_stream(global_stream())"
TO_DEVICE = "returnuniforms.to(device,non_blocking=True)"
PREPARE = (
    "request_ids=list(input_batch.req_ids)query_start_loc=input_batch.query_start_loc_np[:len(request_ids)+1]"
    "num_rows=int(query_start_loc[-1])pending_output=PendingAuxOutput("
    "routed_experts_gpu=self._capturer.snapshot_routing_data(num_rows),)"
)


def _capture(branches: str, params: str = "self, layer_id, topk_ids") -> ast.stmt:
    """A capture definition: the DP counts read as the releases read them, then ``branches``."""
    head = (
        f"def capture({params}):\n"
        "    num_tokens_dp = ctx.dp_metadata.num_tokens_across_dp_cpu\n"
        "    token_num_per_dp = int(num_tokens_dp[self.dp_rank].item())\n"
        "    max_tokens = int(num_tokens_dp.max().item())\n"
        "    total_with_padding = max_tokens * len(num_tokens_dp)\n"
        "    n = topk_ids.shape[0]\n"
    )
    return ast.parse(head + textwrap.indent(textwrap.dedent(branches), "    ")).body[0]


FUSED_MOE = "_original_FusedMoE = _fused_moe_layer.FusedMoE\n_fused_moe_pkg.FusedMoE = _ascend_FusedMoE\n"
FUSED_MOE_GUARDED = 'if not vllm_version_is("0.23.0"):\n' + textwrap.indent(FUSED_MOE, "    ")
REBINDS_COPIES = (
    "for name, module in list(sys.modules.items()):\n"
    '    if name.startswith("vllm.model_executor.models"):\n'
    "        module.FusedMoEFactory = _ascend_FusedMoE\n"
)


def _rotary(body: str) -> list[ast.stmt]:
    return ast.parse(textwrap.dedent(body)).body


ROTARY_BODY = """
    super().__init__(enforce_enable)
    self.is_neox_style = is_neox_style
    self.enable_fp32_compute = enable_fp32_compute
    if find_spec("flash_attn") is not None:
        from flash_attn.ops.triton.rotary import apply_rotary

        self.apply_rotary_emb_flash_attn = apply_rotary
"""
ROTARY_GUARDED = """
    super().__init__(enforce_enable)
    self.is_neox_style = is_neox_style
    self.enable_fp32_compute = enable_fp32_compute
    with suppress(ModuleNotFoundError):
        from flash_attn.ops.triton.rotary import apply_rotary
"""

FINISHED = "defrequest_finished(self,request,block_ids):"
FINISHED_PARAMS = ("self", "request", "block_ids")
DECODE_RETURN = (
    'ifnotparams.get("do_remote_decode")orrequest.status!=RequestStatus.FINISHED_LENGTH_CAPPED:returnFalse,None'
)

TRUNCATE = "def_truncate_request_for_prefill(self,request):"
DROPS = 'request._all_token_ids.pop()request.num_prompt_tokens-=1params["_p_side_truncated"]=True'
LOAD = "defstart_load_kv(self,metadata):"
CP_ONLY = (
    "remote_port_send_num=(self.remote_port_send_num[meta.remote_engine_id]ifmeta.remote_dcp_size>1elseNone)"
    "self.kv_recv_thread.add_request(request_id=req_id,remote_port_send_num=remote_port_send_num)"
)
HYBRID_PULLS = Code("def_get_hybrid_remote_rank_group_pulls(self,req_id,prefill_tp_size):...", ("self", "req_id", "n"))
ADD_REQUEST = Code("defadd_request(...):...", ("self", "request_id", "remote_request_id", "remote_port_send_num"))

SLEEP_DEF = 'defsleep(self,level=1):allocator=CaMemAllocator.get_instance()allocator.sleep(offload_tags=("weights",))'
WAKE_UP = Code("defwake_up(self,tags=None):allocator.wake_up(tags=tags)", ("self", "tags"))
REGISTER_BUFFER = Code(
    "defregister_buffer(self,ptrs,sizes):ifself.is_register_buffer:return"
    "forptr,sizeinzip(ptrs,sizes):ret=self.transfer_engine.register_memory(ptr,size)self.is_register_buffer=True",
    ("self", "ptrs", "sizes"),
)


def reregister(sleep: str, wake_up: Code | None = WAKE_UP, register: Code | None = REGISTER_BUFFER) -> Verdict:
    return ascend_mooncake_sleep_reregister.reregister_rule(Code(sleep, ("self", "level")), wake_up, register)


EXPERT_IDS_INIT = Code(
    "def__init__(self,**kwargs):super().__init__(**kwargs)ifself.num_local_experts>1:"
    "self.expert_ids_per_ep_rank=torch.tensor([i%self.num_local_expertsforiinrange(self.num_experts)])",
    ("self", "kwargs"),
)
CAMEM_WAKE_UP = Code("defwake_up(self,tags=None):fordatain...:create_and_map(handle)", ("self", "tags"))


def expert_ids(
    init: Code = EXPERT_IDS_INIT, wake_up: Code | None = CAMEM_WAKE_UP, fused_moe: str | None = "setup_moe_comm_method("
) -> Verdict:
    return ascend_dispatcher_expert_ids_sleep.expert_ids_rule.decide(init, wake_up, fused_moe)


WAKE_FLIP = (
    "defwake_up(self,tags=None):allocator=CaMemAllocator.get_instance()allocator.wake_up(tags=tags)"
    "if'w2_weight'innameandparam.shape[2]==hidden_size:w2_data=param.transpose(1,2)"
    "setattr(parent_module,param_name,w2_data)elif'w13_weight'innameandparam.shape[1]==hidden_size:"
    "w13_data=param.transpose(1,2)setattr(parent_module,param_name,w13_data)"
)
WAKE_KEEP = "defwake_up(self,tags=None):allocator=CaMemAllocator.get_instance()allocator.wake_up(tags=tags)"


def wake_layout(source: str, params: tuple[str, ...] = ("self", "tags")) -> Verdict:
    return ascend_wake_expert_layout.wake_layout_rule(Code(source, params))


MXFP8_NEW = (
    'defprocess_weights_after_loading(self,layer):ifgetattr(layer,"_mxfp8_transformed",False):return'
    "layer.weight.data=layer.weight.data.transpose(0,1).contiguous()"
    "layer.weight_scale.data=layer.weight_scale.data.transpose(0,1).contiguous()layer._mxfp8_transformed=True"
)
MXFP8_ONCE = (
    'defprocess_weights_after_loading(self,layer):ifnothasattr(layer,"_mxfp8_weight_buf"):'
    "layer._mxfp8_weight_buf=layer.weight.data.transpose(0,1).contiguous()"
    "else:layer._mxfp8_weight_buf.copy_(layer.weight.data.transpose(0,1).contiguous())"
)
MXFP8_VIEW = "defprocess_weights_after_loading(self,layer):layer.weight.data=layer.weight.data.transpose(0,1)"


TID2EID_PARAMS = ("self", "config", "parallel_config", "quant_config", "prefix", "is_draft_layer")
TID2EID_ZEROS = "ifself.hash:self.gate.tid2eid=nn.Parameter(torch.zeros(config.vocab_size,k,dtype=torch.int32))"
TID2EID_DISTINCT = "ifself.hash:t=(ids+offsets)%config.n_routed_expertsself.gate.tid2eid=nn.Parameter(t)"


def tid2eid(source: str, params: tuple[str, ...] = TID2EID_PARAMS) -> Verdict:
    return ascend_dsv4_dummy_tid2eid.tid2eid_rule(Code(source, params))


WO_A_LOAD = (
    "defload_weights(self,model,model_config):forlayerinmodel.modules():initialize_dummy_weights(layer,model_config)"
)
WO_A_LOADER = Code(
    'defweight_loader(self,param,loaded_weight):if"wo_a"inself.prefixandget_ascend_device_type()!=AscendDeviceType.A5:'
    "self.weight.data=self.weight.data.view(self.n_local_groups,self.o_lora_rank,-1).transpose(2,1).contiguous()",
    ("self", "param", "loaded_weight"),
)
WO_A_PROCESS = Code(
    "defprocess_weights_after_loading(self,layer):super().process_weights_after_loading(layer)", ("self", "layer")
)
WO_A_PROCESS_3D = Code(
    f"{WO_A_PROCESS.source}layer.weight.data=layer.weight.data.view(layer.n_local_groups,layer.o_lora_rank,-1).transpose(2,1)",
    ("self", "layer"),
)


def wo_a(load: str = WO_A_LOAD, loader: Code | None = WO_A_LOADER, process: Code | None = WO_A_PROCESS) -> Verdict:
    return ascend_dsv4_dummy_wo_a.wo_a_rule(Code(load, ("self", "model", "model_config")), loader, process)


BUFFERS_REGISTER = (
    "defget_or_register_attention_buffer(vllm_config,layer_names,name,factory):ifbufferisNone:buffer=factory()"
)
BUFFERS_INIT = Code(
    'definitialize_from_config(self,kv_cache_config):context=allocator.use_memory_pool(tag="kv_cache")'
    "withcontext:self.model_runner.initialize_kv_cache(kv_cache_config)",
    ("self", "kv_cache_config"),
)
BUFFERS_INIT_028 = Code(
    "definitialize_from_config(self,kv_cache_config):self.model_runner.initialize_kv_cache(kv_cache_config,"
    'kv_cache_allocation_context=self._maybe_get_memory_pool_context(tag="kv_cache"))',
    ("self", "kv_cache_config"),
)
BUFFERS_SLEEP = Code(
    "defsleep(self,offload_tags=None):fordatainself.pointer_to_data.values():"
    "ifdata.tag==CaMemAllocator.sleep_persistent_tag:continue",
    ("self", "offload_tags"),
)


def buffers(
    register: str = BUFFERS_REGISTER, init: Code | None = BUFFERS_INIT, sleep: Code | None = BUFFERS_SLEEP
) -> Verdict:
    params = ascend_attention_buffers_keep_mapped.PARAMS
    return ascend_attention_buffers_keep_mapped.buffers_rule(Code(register, params), init, sleep)


def mxfp8(source: str, params: tuple[str, ...] = ("self", "layer")) -> Verdict:
    return ascend_mxfp8_reload_in_place.mxfp8_rule(Code(source, params))


def send_counts(load: str, pulls: Code | None = HYBRID_PULLS, add: Code | None = ADD_REQUEST) -> Verdict:
    return ascend_mooncake_hybrid_send_counts.send_counts_rule(Code(load, ("self", "metadata")), pulls, add)


ASYNC_CALL = megatron_async_save_format.CALL


def _write_item_27(transforms: object, stream: object, data: object, item: object, key: str) -> None:
    """torch 2.7's ``_write_item`` parameters."""


def _write_item_28(
    transforms: object, stream: object, data: object, item: object, key: str, serialization_format: object
) -> None:
    """torch >= 2.8's."""


def _write_item_defaulted(
    transforms: object, stream: object, data: object, item: object, key: str, serialization_format: object = None
) -> None:
    """A torch that gives the argument a default."""


CASES: dict[str, tuple[Callable[[], Verdict | str], str]] = {
    # ascend.camem_sleep_sync
    "camem: unmap without sync": (
        lambda: ascend_camem_sleep_sync.camem_rule(Code(f"defsleep(){UNMAP}", SLEEP)),
        "apply",
    ),
    "camem: sync before unmap": (
        lambda: ascend_camem_sleep_sync.camem_rule(Code(f"defsleep():torch.npu.synchronize(){UNMAP}", SLEEP)),
        "fixed-upstream",
    ),
    "camem: other parameters": (lambda: ascend_camem_sleep_sync.camem_rule(Code(UNMAP, ("self",))), "unsupported"),
    "camem: no unmap": (lambda: ascend_camem_sleep_sync.camem_rule(Code("defsleep():pass", SLEEP)), "unsupported"),
    # megatron.expert_bias_fp32
    "expert bias: bf16 cast": (
        lambda: megatron_expert_bias_fp32.float16_rule(Code(f"{FLOAT16}ifself.fp16:m=module.half()", F16_PARAMS)),
        "apply",
    ),
    "expert bias: keeps it": (
        lambda: megatron_expert_bias_fp32.float16_rule(
            Code(f"{FLOAT16}m=module.bfloat16()keep(module,'expert_bias')", F16_PARAMS)
        ),
        "fixed-upstream",
    ),
    "expert bias: no cast": (
        lambda: megatron_expert_bias_fp32.float16_rule(Code(f"{FLOAT16}m=module.to(dtype)", F16_PARAMS)),
        "unsupported",
    ),
    "expert bias: other parameters": (
        lambda: megatron_expert_bias_fp32.float16_rule(Code("def__init__(self,m):m.half()", ("self", "m"))),
        "unsupported",
    ),
    # ascend.mooncake_aborted_receive
    "mooncake: 0.23.0 decode-side return only": (
        lambda: ascend_mooncake_aborted_receive.finished_rule(Code(f"{FINISHED}{DECODE_RETURN}", FINISHED_PARAMS)),
        "apply",
    ),
    "mooncake: 0.26.0rc1 empty receive while waiting": (
        lambda: ascend_mooncake_aborted_receive.finished_rule(
            Code(f'{FINISHED}ifparams.get("do_remote_prefill"):q(){DECODE_RETURN}', FINISHED_PARAMS)
        ),
        "apply",
    ),
    "mooncake: replaces a queued receive": (
        lambda: ascend_mooncake_aborted_receive.finished_rule(
            Code(f"{FINISHED}ifrequest.request_idinself._reqs_need_recv:q(){DECODE_RETURN}", FINISHED_PARAMS)
        ),
        "fixed-upstream",
    ),
    "mooncake: another body": (
        lambda: ascend_mooncake_aborted_receive.finished_rule(Code(f"{FINISHED}returnFalse,None", FINISHED_PARAMS)),
        "unsupported",
    ),
    "mooncake: other parameters": (
        lambda: ascend_mooncake_aborted_receive.finished_rule(Code(DECODE_RETURN, ("self", "request"))),
        "unsupported",
    ),
    # ascend.mooncake_truncate_rehash
    "truncate: drops the token, keeps the hashes": (
        lambda: ascend_mooncake_truncate_rehash.truncate_rule(Code(f"{TRUNCATE}{DROPS}", ("self", "request"))),
        "apply",
    ),
    "truncate: rehashes": (
        lambda: ascend_mooncake_truncate_rehash.truncate_rule(
            Code(f"{TRUNCATE}{DROPS}request.block_hashes.clear()request.update_block_hashes()", ("self", "request"))
        ),
        "fixed-upstream",
    ),
    "truncate: another body": (
        lambda: ascend_mooncake_truncate_rehash.truncate_rule(Code(f"{TRUNCATE}pass", ("self", "request"))),
        "unsupported",
    ),
    "truncate: other parameters": (
        lambda: ascend_mooncake_truncate_rehash.truncate_rule(Code(DROPS, ("self", "request", "n"))),
        "unsupported",
    ),
    # ascend.mooncake_hybrid_send_counts
    "hybrid counts: CP counts only": (lambda: send_counts(f"{LOAD}{CP_ONLY}"), "apply"),
    "hybrid counts: counted for hybrid requests": (
        lambda: send_counts(f"{LOAD}ifself._is_hma_required:n=self._get_hybrid_remote_port_send_num(){CP_ONLY}"),
        "fixed-upstream",
    ),
    "hybrid counts: no hybrid transfers": (lambda: send_counts(f"{LOAD}{CP_ONLY}", pulls=None), "unsupported"),
    "hybrid counts: counts passed positionally": (
        lambda: send_counts(f"{LOAD}self.kv_recv_thread.add_request(req_id,n)"),
        "unsupported",
    ),
    "hybrid counts: add_request without counts": (
        lambda: send_counts(f"{LOAD}{CP_ONLY}", add=Code("defadd_request(self,r):...", ("self", "r"))),
        "unsupported",
    ),
    "hybrid counts: other parameters": (
        lambda: ascend_mooncake_hybrid_send_counts.send_counts_rule(
            Code(CP_ONLY, ("self", "metadata", "n")), HYBRID_PULLS, ADD_REQUEST
        ),
        "unsupported",
    ),
    # ascend.dispatcher_expert_ids_sleep: the dispatcher's __init__, CaMem's wake_up, fused_moe.py's text
    "expert ids: 0.26.0rc1 plain attribute": (lambda: expert_ids(), "apply"),
    "expert ids: no fused_moe.py": (lambda: expert_ids(fused_moe=None), "apply"),
    "expert ids: registered as a buffer": (
        lambda: expert_ids(
            fused_moe='self.routed_experts.register_buffer("expert_ids_per_ep_rank",ids,persistent=False)'
        ),
        "fixed-upstream",
    ),
    "expert ids: __init__ without the tensor": (
        lambda: expert_ids(Code("def__init__(self,**kwargs):pass", ("self", "kwargs"))),
        "unsupported",
    ),
    "expert ids: other parameters": (lambda: expert_ids(Code(EXPERT_IDS_INIT.source, ("self",))), "unsupported"),
    "expert ids: no CaMem wake_up": (lambda: expert_ids(wake_up=None), "unsupported"),
    "expert ids: wake_up without tags": (
        lambda: expert_ids(wake_up=Code("defwake_up(self):create_and_map(handle)", ("self",))),
        "unsupported",
    ),
    # ascend.wake_expert_layout: NPUWorker.wake_up
    "wake layout: 0.25.1rc1 flips w13/w2 at every weights wake": (lambda: wake_layout(WAKE_FLIP), "apply"),
    "wake layout: 0.26.0rc1 leaves them alone": (lambda: wake_layout(WAKE_KEEP), "fixed-upstream"),
    "wake layout: another transpose": (
        lambda: wake_layout(f"{WAKE_KEEP}w=param.transpose(1,2).contiguous()"),
        "unsupported",
    ),
    "wake layout: no CaMem wake-up": (lambda: wake_layout("defwake_up(self,tags=None):pass"), "unsupported"),
    "wake layout: other parameters": (lambda: wake_layout(WAKE_FLIP, ("self",)), "unsupported"),
    # ascend.dsv4_dummy_tid2eid: DeepseekV4MoE.__init__
    "tid2eid: 0.27.1rc1 zeros": (lambda: tid2eid(TID2EID_ZEROS), "apply"),
    "tid2eid: 0.28.0rc1 distinct ids": (lambda: tid2eid(TID2EID_DISTINCT), "fixed-upstream"),
    "tid2eid: no hash table": (lambda: tid2eid("self.gate=ReplicatedLinear()"), "unsupported"),
    "tid2eid: other parameters": (lambda: tid2eid(TID2EID_ZEROS, ("self", "config")), "unsupported"),
    # ascend.attention_buffers_keep_mapped: get_or_register_attention_buffer, the worker, CaMem
    "attention buffers: 0.27.1rc1 made inside the kv_cache pool": (lambda: buffers(), "apply"),
    "attention buffers: 0.28.0rc1 pool around the KV tensors only": (
        lambda: buffers(init=BUFFERS_INIT_028),
        "fixed-upstream",
    ),
    "attention buffers: allocated under a persistent tag": (
        lambda: buffers(
            BUFFERS_REGISTER.replace("buffer=factory()", "withallocator.use_allocation_tag(t):buffer=factory()")
        ),
        "fixed-upstream",
    ),
    "attention buffers: no persistent tag in CaMem": (
        lambda: buffers(sleep=Code("defsleep(self,offload_tags=None):pass", ("self", "offload_tags"))),
        "unsupported",
    ),
    "attention buffers: no worker": (lambda: buffers(init=None), "unsupported"),
    "attention buffers: another body": (
        lambda: buffers("defget_or_register_attention_buffer(vllm_config,layer_names,name,factory):pass"),
        "unsupported",
    ),
    "attention buffers: other parameters": (
        lambda: ascend_attention_buffers_keep_mapped.buffers_rule(
            Code(BUFFERS_REGISTER, ("name",)), BUFFERS_INIT, BUFFERS_SLEEP
        ),
        "unsupported",
    ),
    # ascend.dsv4_dummy_wo_a: vLLM's DummyModelLoader.load_weights, read with vllm-ascend's linear.py
    "wo_a: 0.26.0rc1 reshapes in the weight loader only": (lambda: wo_a(), "apply"),
    "wo_a: 0.27.1rc1 fusion condition": (
        lambda: wo_a(
            loader=Code(
                WO_A_LOADER.source.replace(  # type: ignore[union-attr]
                    "get_ascend_device_type()!=AscendDeviceType.A5", "HardwareCapability.DYNAMIC_MX_QUANT_FUSION"
                ),
                WO_A_LOADER.params,
            )
        ),
        "apply",
    ),
    "wo_a: 0.28.0rc1 reshapes after loading": (lambda: wo_a(process=WO_A_PROCESS_3D), "fixed-upstream"),
    "wo_a: vLLM 0.30 fills each tensor": (
        lambda: wo_a(
            WO_A_LOAD.replace("initialize_dummy_weights(layer,model_config)", "initialize_single_dummy_weight(t)")
        ),
        "apply",
    ),
    "wo_a: no DeepSeek-V4 wo_a (0.18.0)": (
        lambda: wo_a(loader=Code("defweight_loader(self,p,w):pass", None)),
        "unsupported",
    ),
    "wo_a: another reshape condition": (
        lambda: wo_a(
            loader=Code(WO_A_LOADER.source.replace("get_ascend_device_type()!=AscendDeviceType.A5", "True"), None)
        ),  # type: ignore[union-attr]
        "unsupported",
    ),
    "wo_a: another dummy loader": (lambda: wo_a("defload_weights(self,model,model_config):pass"), "unsupported"),
    "wo_a: other parameters": (
        lambda: ascend_dsv4_dummy_wo_a.wo_a_rule(Code(WO_A_LOAD, ("self", "model")), WO_A_LOADER, WO_A_PROCESS),
        "unsupported",
    ),
    # ascend.mxfp8_reload_in_place: AscendW8A8MXFP8DynamicLinearMethod.process_weights_after_loading
    "mxfp8: 0.23.0 new tensors at every reload": (lambda: mxfp8(MXFP8_NEW), "apply"),
    "mxfp8: 0.23.0.post1 buffers made once": (lambda: mxfp8(MXFP8_ONCE), "fixed-upstream"),
    "mxfp8: 0.18.0 transposes by view": (lambda: mxfp8(MXFP8_VIEW), "unsupported"),
    "mxfp8: other parameters": (lambda: mxfp8(MXFP8_NEW, ("self",)), "unsupported"),
    # ascend.mooncake_sleep_reregister
    "sleep reregister: 0.23.0 sleep, wake-up, registration": (lambda: reregister(SLEEP_DEF), "apply"),
    "sleep reregister: sleep unregisters": (
        lambda: reregister(f"{SLEEP_DEF}global_te.unregister_buffer()"),
        "fixed-upstream",
    ),
    "sleep reregister: no transfer engine there": (lambda: reregister(SLEEP_DEF, register=None), "unsupported"),
    "sleep reregister: another sleep": (lambda: reregister("defsleep(self,level=1):pass"), "unsupported"),
    "sleep reregister: wake_up without tags": (
        lambda: reregister(SLEEP_DEF, wake_up=Code("defwake_up(self):allocator.wake_up()", ("self",))),
        "unsupported",
    ),
    "sleep reregister: another registration": (
        lambda: reregister(SLEEP_DEF, register=Code("defregister_buffer(self,regions):...", ("self", "regions"))),
        "unsupported",
    ),
    "sleep reregister: other parameters": (
        lambda: ascend_mooncake_sleep_reregister.reregister_rule(Code(SLEEP_DEF, ("self",)), WAKE_UP, REGISTER_BUFFER),
        "unsupported",
    ),
    # megatron.async_save_format: the writer's call, then torch's function
    "async save: 0.12.1 call": (
        lambda: megatron_async_save_format.writer_rule(Code(f"defwrite_preloaded_data():{ASYNC_CALL}", None)),
        "apply",
    ),
    "async save: passes the format": (
        lambda: megatron_async_save_format.writer_rule(
            Code(f"defw():kw['serialization_format']=f{ASYNC_CALL[:-1]},**kw)", None)
        ),
        "fixed-upstream",
    ),
    "async save: another call": (
        lambda: megatron_async_save_format.writer_rule(Code("defw():write(stream,item)", None)),
        "unsupported",
    ),
    "async save: torch requires the format": (
        lambda: megatron_async_save_format.torch_rule(parameter_defaults(_write_item_28)),
        "apply",
    ),
    "async save: torch < 2.8": (
        lambda: megatron_async_save_format.torch_rule(parameter_defaults(_write_item_27)),
        "fixed-upstream",
    ),
    "async save: torch defaults it": (
        lambda: megatron_async_save_format.torch_rule(parameter_defaults(_write_item_defaulted)),
        "fixed-upstream",
    ),
    "async save: no signature": (
        lambda: megatron_async_save_format.torch_rule(parameter_defaults(object())),
        "unsupported",
    ),
    # verl.distillation_log_prob_floor
    "distillation: 0.9.1 unfloored": (
        lambda: verl_distillation_log_prob_floor.estimator_rule(Code(f"{ESTIMATOR}{UNFLOORED}", ESTIMATOR_PARAMS)),
        "apply",
    ),
    "distillation: PR 7333 floor": (
        lambda: verl_distillation_log_prob_floor.estimator_rule(
            Code(f"{ESTIMATOR}{UNFLOORED}ifloss_config.log_prob_min_clampisnotNone:x=1", ESTIMATOR_PARAMS)
        ),
        "fixed-upstream",
    ),
    "distillation: another body": (
        lambda: verl_distillation_log_prob_floor.estimator_rule(Code(f"{ESTIMATOR}return0", ESTIMATOR_PARAMS)),
        "unsupported",
    ),
    "distillation: other parameters": (
        lambda: verl_distillation_log_prob_floor.estimator_rule(Code(UNFLOORED, ("config", "data"))),
        "unsupported",
    ),
    # verl.npu_version_probe
    "npu probe: card 1": (
        lambda: verl_npu_version_probe.probe_rule(Code(f"{PROBE}{verl_npu_version_probe.CARD_ONE}", ())),
        "apply",
    ),
    "npu probe: reads the mapping": (
        lambda: verl_npu_version_probe.probe_rule(Code(f'{PROBE}m=run(["npu-smi","info","-m"])', ())),
        "fixed-upstream",
    ),
    "npu probe: another probe": (
        lambda: verl_npu_version_probe.probe_rule(Code(f'{PROBE}run(["npu-smi","info"])', ())),
        "unsupported",
    ),
    # verl.checkpoint_send_reoffload
    "reoffload: 0.9.1 send then return": (
        lambda: verl_checkpoint_send_reoffload.reoffload_rule(Code(f"{UPDATE}{SEND}returnmetricsor{{}}{NAIVE}", None)),
        "apply",
    ),
    "reoffload: 0.8.0 bare return": (
        lambda: verl_checkpoint_send_reoffload.reoffload_rule(Code(f"{UPDATE}{SEND}return{NAIVE}", None)),
        "apply",
    ),
    "reoffload: PR 7631": (
        lambda: verl_checkpoint_send_reoffload.reoffload_rule(
            Code(f'{UPDATE}{SEND}ifself.actor.engine.is_param_offload_enabled:self.actor.engine.to("cpu")return', None)
        ),
        "fixed-upstream",
    ),
    "reoffload: no checkpoint-engine send": (
        lambda: verl_checkpoint_send_reoffload.reoffload_rule(Code(f"{UPDATE}{NAIVE}", None)),
        "unsupported",
    ),
    # megatron.bridge_mindspeed_te (Megatron-Bridge's AutoMapping and MindSpeed's TE class names)
    "bridge mindspeed: 0.3.0 knows no MindSpeed class": (
        lambda: bridge.detection_rule(Code(DETECT, DETECTION), bridge.Known(TE_REGISTRY)).reason,
        "AutoMapping knows none of MindSpeed's 9 TE classes",
    ),
    "bridge mindspeed: 0.5.0's substring catches the fused class only": (
        lambda: bridge.detection_rule(Code(DETECT_05, DETECTION), bridge.Known(TE_REGISTRY, SUBSTRING)).reason,
        f"AutoMapping knows 1 ({bridge.FUSED}) of MindSpeed's 9 TE classes",
    ),
    "bridge mindspeed: a registry entry for the fused class (the hand fix) does not count": (
        lambda: (
            bridge.detection_rule(
                Code(DETECT, DETECTION),
                bridge.Known({**ALL_BUT_FUSED, "column": ALL_BUT_FUSED["column"] | {bridge.FUSED}}),
            ).reason
        ),
        "AutoMapping knows 8 (MindSpeedTEColumnParallelGroupedLinear, MindSpeedTERowParallelGroupedLinear,"
        " MindSpeedTEPerformanceColumnParallelGroupedLinear, MindSpeedTEPerformanceRowParallelGroupedLinear,"
        " MindSpeedTELayernorm, MindSpeedTEDotProductAttention, MindSpeedTELinear, MindSpeedTEColumnParallelLinear)"
        " of MindSpeed's 9 TE classes",
    ),
    "bridge mindspeed: every class known, the fused one by the method": (
        lambda: bridge.detection_rule(Code(DETECT_05, DETECTION), bridge.Known(ALL_BUT_FUSED, SUBSTRING)),
        "fixed-upstream",
    ),
    "bridge mindspeed: another signature": (
        lambda: bridge.detection_rule(Code(DETECT, ("self", "module", "param")), bridge.Known(TE_REGISTRY)),
        "unsupported",
    ),
    "bridge mindspeed: no registry lookup in the method": (
        lambda: bridge.detection_rule(
            Code(DETECT.replace("self._MODULE_TYPE_REGISTRY", "REGISTRY"), DETECTION), bridge.Known(TE_REGISTRY)
        ),
        "unsupported",
    ),
    "bridge mindspeed: no per-parameter rule for the fused class": (
        lambda: bridge.detection_rule(
            Code(DETECT.replace("layer_norm_weight", "norm"), DETECTION), bridge.Known(TE_REGISTRY)
        ),
        "unsupported",
    ),
    "bridge mindspeed: no registry on the class": (
        lambda: bridge.detection_rule(Code(DETECT, DETECTION), None),
        "unsupported",
    ),
    "bridge mindspeed: TE's grouped linears unknown": (
        lambda: (
            bridge.detection_rule(
                Code(DETECT, DETECTION),
                bridge.Known({k: {n for n in v if "Grouped" not in n} for k, v in TE_REGISTRY.items()}),
            ).reason
        ),
        "expected AutoMapping knowing TE's TEColumnParallelGroupedLinear, TERowParallelGroupedLinear; found none",
    ),
    # verl.hccl_broadcast_thread (0.9.0's executor; 0.8.0 / 0.9.1 call _run on the caller)
    "hccl broadcast: 0.9.0 executor": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(Code(f"{INIT}{STORED}{hccl.THREADED}", HCCL), AWAITS_TASK),
        "apply",
    ),
    "hccl broadcast: 0.9.1 revert": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(Code(f"{INIT}{STORED}self._run()", HCCL), RETURNS_AT_ONCE),
        "fixed-upstream",
    ),
    "hccl broadcast: executor, wait_for_complete not awaiting the task": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(
            Code(f"{INIT}{STORED}{hccl.THREADED}", HCCL), RETURNS_AT_ONCE
        ),
        "unsupported",
    ),
    "hccl broadcast: executor, module without wait_for_complete": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(Code(f"{INIT}{STORED}{hccl.THREADED}", HCCL), None),
        "unsupported",
    ),
    "hccl broadcast: a further statement after the executor": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(
            Code(f"{INIT}{STORED}{hccl.THREADED}self._done=False", HCCL), AWAITS_TASK
        ),
        "unsupported",
    ),
    "hccl broadcast: a thread of its own": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(
            Code(f"{INIT}{STORED}threading.Thread(target=self._run).start()", HCCL), AWAITS_TASK
        ),
        "unsupported",
    ),
    "hccl broadcast: attributes stored otherwise": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(Code(f"{INIT}self.group=process_group", HCCL), AWAITS_TASK),
        "unsupported",
    ),
    "hccl broadcast: another signature": (
        lambda: verl_hccl_broadcast_thread.broadcast_rule(
            Code(f"{INIT}{STORED}self._run()", ("self",)), RETURNS_AT_ONCE
        ),
        "unsupported",
    ),
    # megatron.mtp_postprocess
    "mtp: 0.16 not-None guard": (
        lambda: megatron_mtp_postprocess.postprocess_rule(
            Code(f"{POSTPROCESS}ifself.config.mtp_num_layersisnotNone:x=labels.clone()", None)
        ),
        "apply",
    ),
    "mtp: 0.17 truth test": (
        lambda: megatron_mtp_postprocess.postprocess_rule(Code(f"{POSTPROCESS}ifself.config.mtp_num_layers:x=1", None)),
        "fixed-upstream",
    ),
    "mtp: 0.15 mtp_process": (
        lambda: megatron_mtp_postprocess.postprocess_rule(Code(f"{POSTPROCESS}ifself.mtp_process:x=1", None)),
        "unsupported",
    ),
    # tensordict.npu_sync
    "tensordict: 0.9 CUDA/MPS only": (lambda: tensordict_npu_sync.sync_rule(Code(SYNC_09, ("self",))), "apply"),
    "tensordict: 0.10 generic": (
        lambda: tensordict_npu_sync.sync_rule(
            Code("def_sync_all(self):m=_get_device_module(_get_available_device_type())m.synchronize()", ("self",))
        ),
        "fixed-upstream",
    ),
    "tensordict: another body": (lambda: tensordict_npu_sync.sync_rule(Code("pass", ("self",))), "unsupported"),
    # vllm.engine_partial_wake_up
    "engine: both needed": (
        lambda: vllm_engine_partial_wake_up.partial_wake_up_rule(
            Code(WAKE, ("self", "tags")), Code(DUMMY, ("self",)), Code(LOOP, ())
        ),
        "apply",
    ),
    "engine: wake_up fixed upstream": (
        lambda: vllm_engine_partial_wake_up.wake_up_state(
            Code("defwake_up(self,tags=None):ifnotself.model_executor.is_sleeping:self.resume_scheduler()", ("self",))
        ),
        "fixed",
    ),
    "engine: dummy batch fixed upstream": (
        lambda: vllm_engine_partial_wake_up.dummy_batch_state(
            Code(DUMMY, ("self",)),
            Code("ifnotself.model_executor.is_sleeping:self.execute_dummy_batch()", ()),
        ),
        "fixed",
    ),
    "engine: unknown wake_up": (
        lambda: vllm_engine_partial_wake_up.partial_wake_up_rule(Code("pass", ("self", "tags")), None, None),
        "unsupported",
    ),
    # ascend.routed_experts_capture
    "capture: conditional import": (
        lambda: ascend_routed_experts_capture.capture_rule(
            CAPTURE, f"if not main2main:\n    import {ascend_routed_experts_capture.CAPTURE}\n"
        ),
        "apply",
    ),
    "capture: unconditional import": (
        lambda: ascend_routed_experts_capture.capture_rule(
            CAPTURE, f"import {ascend_routed_experts_capture.CAPTURE}\n"
        ),
        "fixed-upstream",
    ),
    "capture: already imported": (
        lambda: ascend_routed_experts_capture.capture_rule(CAPTURE, None, True),
        "fixed-upstream",
    ),
    "capture: no module": (lambda: ascend_routed_experts_capture.capture_rule(None, None), "unsupported"),
    # ascend.routed_experts_dp_padding_trim (_capture_trim)
    "trim: own-rows branch, padded after the all-gather only": (
        lambda: trim_rule(_capture(OWN_ROWS + "elif n == total_with_padding:\n    pass\n"), "c"),
        "apply",
    ),
    "trim: own rows compared the other way round": (
        lambda: trim_rule(_capture("if topk_ids.shape[0] == token_num_per_dp:\n    pass\n"), "c"),
        "apply",
    ),
    "trim: a branch on the widest rank's count": (
        lambda: trim_rule(_capture(OWN_ROWS + "elif n == max_tokens:\n    pass\n"), "c"),
        "fixed-upstream",
    ),
    "trim: concatenated layout only (vLLM 0.18)": (
        lambda: trim_rule(_capture("assert n == token_num_per_dp\n"), "c"),
        "unsupported",
    ),
    "trim: another signature": (
        lambda: trim_rule(_capture(OWN_ROWS, "self, topk_ids"), "c"),
        "unsupported",
    ),
    "trim: no capture": (lambda: trim_rule(None, "c"), "unsupported"),
    # ascend.rms_norm_residual, ascend.sfa_keep_kv_b_proj, ascend.sfa_indexer_scale (glm52_rules)
    "rms_norm: fused add": (
        lambda: glm52_rules.rms_norm_rule(Code("torch_npu.npu_add_rms_norm(x,residual,w)", ("self", "x", "residual"))),
        "apply",
    ),
    "rms_norm: explicit residual": (
        lambda: glm52_rules.rms_norm_rule(
            Code("residual=x+residualtorch_npu.npu_rms_norm(residual,self.weight)", ("self", "x", "residual"))
        ),
        "fixed-upstream",
    ),
    "kv_b_proj: disposed": (
        lambda: glm52_rules.kv_b_proj_rule(Code("dispose_layer(self.kv_b_proj)", ("self", "act_dtype")), True),
        "apply",
    ),
    "kv_b_proj: kept in RL mode, which is on": (
        lambda: glm52_rules.kv_b_proj_rule(Code(glm52_rules.RL_KEEPS, ("self", "act_dtype")), True, True),
        "fixed-upstream",
    ),
    "kv_b_proj: no dispose_layer global": (
        lambda: glm52_rules.kv_b_proj_rule(Code("dispose_layer(self.kv_b_proj)", ("self", "act_dtype")), False),
        "unsupported",
    ),
    "indexer: unscaled weights": (lambda: glm52_rules.indexer_rule(Code("", POST), Code(IMPL, ())), "apply"),
    "indexer: already scaled": (
        lambda: glm52_rules.indexer_rule(Code("", POST), Code("w=w*n_head**-0.5*head_dim**-0.5", ())),
        "fixed-upstream",
    ),
    "indexer backend: unscaled kw": (
        lambda: glm52_rules.indexer_backend_rule(
            Code("", POST[1:]), Code(f"weights=kw[:,self.head_dim:]{glm52_rules.BACKEND_CALL}x)", ()), None
        ),
        "apply",
    ),
    # torch_npu.nested_tensor_intercept
    "nested: intercepted": (
        lambda: torch_npu_nested_tensor_intercept.nested_rule({"a": "intercept", "b": "plain"}),
        "apply",
    ),
    "nested: torch's own": (
        lambda: torch_npu_nested_tensor_intercept.nested_rule({"a": "plain", "b": "ours"}),
        "fixed-upstream",
    ),
    "nested: someone else's": (
        lambda: torch_npu_nested_tensor_intercept.nested_rule({"a": "foreign", "b": "plain"}),
        "unsupported",
    ),
    # transformers.*.deepstack_clone
    "deepstack: in-place write": (
        lambda: transformers_deepstack.deepstack_rule(Code(transformers_deepstack.IN_PLACE, DEEPSTACK)),
        "apply",
    ),
    "deepstack: cloned": (
        lambda: transformers_deepstack.deepstack_rule(Code(transformers_deepstack.CLONED, DEEPSTACK)),
        "fixed-upstream",
    ),
    # ascend.dsv4_rope_plain_swa (the rule; which calls are sliding-window-only layers)
    "dsv4 rope: table from precompute_freqs_cis": (
        lambda: ascend_dsv4_rope_plain_swa.rope_rule(
            Code("inv_freq=self.precompute_freqs_cis(d,m,m,b,f,x,y)", ascend_dsv4_rope_plain_swa.PARAMS)
        ),
        "apply",
    ),
    "dsv4 rope: another table": (
        lambda: ascend_dsv4_rope_plain_swa.rope_rule(Code("inv_freq=table()", ascend_dsv4_rope_plain_swa.PARAMS)),
        "unsupported",
    ),
    "dsv4 rope: another signature": (
        lambda: ascend_dsv4_rope_plain_swa.rope_rule(Code("self.precompute_freqs_cis(", ("self", "config"))),
        "unsupported",
    ),
    "dsv4 rope: window layer, no scaling named": (
        lambda: ascend_dsv4_rope_plain_swa.sliding_window_only(["default"], {}),
        True,
    ),
    "dsv4 rope: groups left to the default": (
        lambda: ascend_dsv4_rope_plain_swa.sliding_window_only(None, {"beta_fast": 32}),
        True,
    ),
    "dsv4 rope: compressed layer": (
        lambda: ascend_dsv4_rope_plain_swa.sliding_window_only(["default", "c4"], {}),
        False,
    ),
    "dsv4 rope: the caller names the scaling": (
        lambda: ascend_dsv4_rope_plain_swa.sliding_window_only(["default"], {"apply_yarn_scaling": True}),
        False,
    ),
    # megatron.layer_offset (the rule; the offset from num_layer_list)
    "layer offset: Megatron's rank, no num_layer_list": (
        lambda: megatron_layer_offset.offset_rule(Code(f"r={megatron_layer_offset.RANK}", ("config", "vp_stage"))),
        "apply",
    ),
    "layer offset: reads num_layer_list": (
        lambda: megatron_layer_offset.offset_rule(
            Code(f"r={megatron_layer_offset.RANK};n=config.num_layer_list", ("config",))
        ),
        "fixed-upstream",
    ),
    "layer offset: other parameters": (
        lambda: megatron_layer_offset.offset_rule(Code(megatron_layer_offset.RANK, ("config", "rank"))),
        "unsupported",
    ),
    "layer offset: uneven list, stage 2": (
        lambda: megatron_layer_offset.uneven_offset(
            types.SimpleNamespace(num_layer_list="'3;2;2'", num_layers=7, pipeline_model_parallel_size=3), 2
        ),
        5,
    ),
    "layer offset: even list": (
        lambda: megatron_layer_offset.uneven_offset(
            types.SimpleNamespace(num_layer_list=[2, 2], num_layers=4, pipeline_model_parallel_size=2), 1
        ),
        None,
    ),
    "layer offset: list not fitting the pipeline": (
        lambda: megatron_layer_offset.uneven_offset(
            types.SimpleNamespace(num_layer_list="3,1", num_layers=4, pipeline_model_parallel_size=3), 1
        ),
        None,
    ),
    # verl.3d_position_ids (the rule; the layout from values' shape, last offset, ragged index)
    "3d ids: blind relabel": (
        lambda: verl_3d_position_ids.position_ids_rule(Code(f"ifx:{verl_3d_position_ids.BLIND}", ("data",))),
        "apply",
    ),
    "3d ids: reads the layout": (
        lambda: verl_3d_position_ids.position_ids_rule(
            Code(f"o=ids.offsets()ifo[-1]==n:{verl_3d_position_ids.BLIND}", ("data",))
        ),
        "fixed-upstream",
    ),
    "3d ids: rebuilds": (
        lambda: verl_3d_position_ids.position_ids_rule(
            Code('data["position_ids"]=nested_tensor_from_tensor_list(x,ragged_idx=2)', ("data",))
        ),
        "fixed-upstream",
    ),
    "3d ids: another body": (
        lambda: verl_3d_position_ids.position_ids_rule(Code("pass", ("data",))),
        "unsupported",
    ),
    "3d ids: other parameters": (
        lambda: verl_3d_position_ids.position_ids_rule(Code(verl_3d_position_ids.BLIND, ("data", "key"))),
        "unsupported",
    ),
    "3d ids layout: ragged over the sequence": (lambda: verl_3d_position_ids.layout((4, 5), 5, 2), "canonical"),
    "3d ids layout: index lost in a pickle": (lambda: verl_3d_position_ids.layout((4, 5), 5, 1), "sequence-packed"),
    "3d ids layout: equal lengths, channels ragged": (
        lambda: verl_3d_position_ids.layout((8, 2), 8, 1),
        "channel-packed",
    ),
    "3d ids layout: both fit, read as channels": (
        lambda: verl_3d_position_ids.layout((4, 4), 4, 1),
        "channel-packed",
    ),
    "3d ids layout: neither fits": (lambda: verl_3d_position_ids.layout((4, 5), 7, 1), "unknown"),
    "3d ids layout: not two-dimensional values": (lambda: verl_3d_position_ids.layout((4, 5, 2), 5, 1), "unknown"),
    # verl.defer_duplicates
    "defer: verl's rotary patcher": (
        lambda: verl_defer_duplicates.rotary_patcher_rule(Code("ApplyRotaryEmb.__init__=init", ()), True),
        "apply",
    ),
    "defer: not verl's": (
        lambda: verl_defer_duplicates.rotary_patcher_rule(Code("ApplyRotaryEmb.__init__=init", ()), False),
        "unsupported",
    ),
    "defer: assigns nothing": (
        lambda: verl_defer_duplicates.rotary_patcher_rule(Code("pass", ()), True),
        "unsupported",
    ),
    # ascend.fused_moe_copies
    "fused_moe copies: replaced, copies left": (lambda: ascend_fused_moe_copies.copies_rule(FUSED_MOE), "apply"),
    "fused_moe copies: not replaced under this vLLM": (
        lambda: ascend_fused_moe_copies.copies_rule(FUSED_MOE, replaced=False),
        "unsupported",
    ),
    "fused_moe copies: copies rebound upstream": (
        lambda: ascend_fused_moe_copies.copies_rule(FUSED_MOE + REBINDS_COPIES),
        "fixed-upstream",
    ),
    "fused_moe copies: no module": (lambda: ascend_fused_moe_copies.copies_rule(None), "unsupported"),
    "fused_moe copies: keeps no original": (
        lambda: ascend_fused_moe_copies.copies_rule("_fused_moe_pkg.FusedMoE = f"),
        "unsupported",
    ),
    "fused_moe copies: guarded by the paired vLLM": (
        lambda: ascend_fused_moe_copies.skipped_under(ModuleSource(FUSED_MOE_GUARDED), "0.23.0"),
        True,
    ),
    "fused_moe copies: guarded by another vLLM": (
        lambda: ascend_fused_moe_copies.skipped_under(ModuleSource(FUSED_MOE_GUARDED), "0.24.0"),
        False,
    ),
    # vllm.moe_weight_loader
    "moe: known loader": (
        lambda: vllm_moe.parameters_rule("L.weight_loader", vllm_moe.EXPECTED_PARAMETERS, "f"),
        "apply",
    ),
    "moe: other loader": (lambda: vllm_moe.parameters_rule("L.weight_loader", ("self",), "f"), "unsupported"),
    # vllm.rotary_flash_attn_guard
    "rotary: unguarded import": (
        lambda: vllm_rotary_flash_attn_guard.rotary_rule(
            vllm_rotary_flash_attn_guard.EXPECTED_SIGNATURE, _rotary(ROTARY_BODY), "f"
        ),
        "apply",
    ),
    "rotary: guarded import": (
        lambda: vllm_rotary_flash_attn_guard.rotary_rule(
            vllm_rotary_flash_attn_guard.EXPECTED_SIGNATURE, _rotary(ROTARY_GUARDED), "f"
        ),
        "fixed-upstream",
    ),
    "rotary: another signature": (lambda: vllm_rotary_flash_attn_guard.rotary_rule("(self)", [], "f"), "unsupported"),
    # ascend.sampler_record_stream
    "sampler: q drawn on the side stream": (
        lambda: ascend_sampler_record_stream.sampler_rule(Code(f"{SIDE_Q}{WAITED}returnprobs.div_(q)", SAMPLE)),
        "apply",
    ),
    "sampler: q recorded": (
        lambda: ascend_sampler_record_stream.sampler_rule(
            Code(f"{SIDE_Q}{WAITED}q.record_stream(torch.npu.current_stream())returnprobs.div_(q)", SAMPLE)
        ),
        "fixed-upstream",
    ),
    "sampler: no side stream": (
        lambda: ascend_sampler_record_stream.sampler_rule(Code("returnprobs.div_(q)", SAMPLE)),
        "unsupported",
    ),
    # ascend.310p_sampler_record_stream
    "310p sampler: q copied on the side stream (0.18.0 - 0.25.1rc1)": (
        lambda: ascend_310p_sampler_record_stream.sampler_310p_rule(
            Code(f"{SIDE_Q_310P}{WAITED}returnprobs.div_(q).argmax(dim=-1)", SAMPLE), None
        ),
        "apply",
    ),
    "310p sampler: q made on the CPU only": (
        lambda: ascend_310p_sampler_record_stream.sampler_310p_rule(
            Code(f"{SIDE_Q_310P.replace('q=q.npu()', '')}{WAITED}returnprobs.div_(q)", SAMPLE), None
        ),
        "unsupported",
    ),
    "310p sampler: uniforms copied on the side stream (0.26.0rc1 on)": (
        lambda: ascend_310p_sampler_record_stream.sampler_310p_rule(
            Code(f"{SIDE_UNIFORMS}{WAITED}sampled=_sample_from_cdf_310p(probs,uniforms)", SAMPLE),
            Code(f"defhelper():{TO_DEVICE}", ()),
        ),
        "apply",
    ),
    "310p sampler: uniforms kept on the host": (
        lambda: ascend_310p_sampler_record_stream.sampler_310p_rule(
            Code(f"{SIDE_UNIFORMS}{WAITED}sampled=_sample_from_cdf_310p(probs,uniforms)", SAMPLE),
            Code("defhelper():returnuniforms", ()),
        ),
        "unsupported",
    ),
    "310p sampler: uniforms recorded": (
        lambda: ascend_310p_sampler_record_stream.sampler_310p_rule(
            Code(
                f"{SIDE_UNIFORMS}{WAITED}uniforms.record_stream(torch.npu.current_stream())"
                "sampled=_sample_from_cdf_310p(probs,uniforms)",
                SAMPLE,
            ),
            Code(f"defhelper():{TO_DEVICE}", ()),
        ),
        "fixed-upstream",
    ),
    "310p sampler: other parameters": (
        lambda: ascend_310p_sampler_record_stream.sampler_310p_rule(Code(SIDE_Q_310P, ("probs",)), None),
        "unsupported",
    ),
    # vllm.routed_experts_padding_slots
    "padding slots: slot buffer store": (
        lambda: vllm_routed_experts_padding_slots.slots_rule(
            Code("self.routed_experts_by_slot[slot_mapping]=data", vllm_routed_experts_padding_slots.PARAMS)
        ),
        "apply",
    ),
    "padding slots: masked store": (
        lambda: vllm_routed_experts_padding_slots.slots_rule(
            Code(
                "m=slot_mapping>=0self.routed_experts_by_slot[slot_mapping[m]]=data[m]",
                vllm_routed_experts_padding_slots.PARAMS,
            )
        ),
        "fixed-upstream",
    ),
    "padding slots: capture path snapshots the scheduled rows (0.32 on)": (
        lambda: vllm_routed_experts_padding_slots.capture_rule(Code(PREPARE, ("self", "input_batch"))),
        "fixed-upstream",
    ),
    "padding slots: capture path snapshotting the whole buffer": (
        lambda: vllm_routed_experts_padding_slots.capture_rule(
            Code(PREPARE.replace("(num_rows)", "(len(self._capturer.device_buffer))"), ("self", "input_batch"))
        ),
        "unsupported",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_rule_decides(case: str) -> None:
    rule, expected = CASES[case]
    decided = rule()
    assert (decided if isinstance(decided, (str, int, type(None))) else decided.action) == expected, decided


def _mixed(a: int, /, b: int, c: int = 1, *args: int, d: int, e: int = 2, **kw: int) -> None:
    """Every kind of parameter, with and without defaults."""


@pytest.mark.parametrize("function", [_write_item_27, _write_item_28, _write_item_defaulted, _mixed], ids=str)
def test_a_def_read_from_source_has_the_live_functions_defaults(function: Callable[..., None]) -> None:
    """The torch side of ``megatron.async_save_format`` reads the same from torch's file (the table)
    as from its function (the live check)."""
    import inspect

    (node,) = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    assert isinstance(node, ast.FunctionDef)
    assert definition_defaults(node) == parameter_defaults(function)


def test_which_parameters_a_caller_may_leave_out() -> None:
    found = parameter_defaults(_mixed)
    assert found == {"a": False, "b": False, "c": True, "args": True, "d": False, "e": True, "kw": True}


def test_torch_nested_functions_read_from_source_are_plain_only_undecorated() -> None:
    rule = torch_npu_nested_tensor_intercept.PATCHES[0].static
    assert rule is not None
    (torch_side,) = rule.also
    plain = "def nested_tensor(x):\n    pass\ndef as_nested_tensor(x):\n    pass\n"
    decorated = (
        "import functools\n@functools.lru_cache\ndef nested_tensor(x):\n    pass\ndef as_nested_tensor(x):\n    pass\n"
    )
    verdicts = {}
    for name, text in (("plain", plain), ("decorated", decorated), ("missing", "x = 1\n")):
        tree = types.SimpleNamespace(
            module=lambda module, text=text: ModuleSource(text) if module == "torch.nested" else None
        )
        verdicts[name] = torch_side.decide(tree).action
    assert verdicts == {"plain": "fixed-upstream", "decorated": "unsupported", "missing": "unsupported"}


def _apply_liger_kernel_to_toy(rope: bool = True, swiglu: bool = True, rms_norm: bool = False) -> None:
    """Liger's shape: each switch rebinds some module attributes."""
    from types import SimpleNamespace

    modeling = SimpleNamespace()
    if rope:
        modeling.apply_rotary_pos_emb = None
    if swiglu:
        modeling.ToyMLP = None
    elif rms_norm:
        modeling.ToyRMSNorm = None


def test_liger_rebound_names_reads_each_switchs_branches() -> None:
    assert liger_arbitration.rebound_names(_apply_liger_kernel_to_toy) == {
        "rope": {"apply_rotary_pos_emb"},
        "swiglu": {"ToyMLP"},
        "rms_norm": {"ToyRMSNorm"},
    }


def test_the_first_card_is_the_first_npu_id_with_a_logical_chip() -> None:
    header = "\tNPU ID  Chip ID  Chip Logic ID  Chip Name\n"
    a3 = header + "\t2  0  0  Ascend 910_9392\n\t2  1  1  Ascend 910_9392\n\t2  2  -  Mcu\n"
    mcu_first = header + "\t4  1  -  Mcu\n\t5  0  1  Ascend 910B1\n"
    assert verl_npu_version_probe.first_card(a3) == 2
    assert verl_npu_version_probe.first_card(mcu_first) == 5
    assert verl_npu_version_probe.first_card("Software Version : 25.5.0\n") is None


def test_bridge_mindspeed_reads_the_registry_and_constants_from_the_class_body(tmp_path: Path) -> None:
    """The table reads ``AutoMapping``'s registry and string constants from the release's source, as the
    live check reads them from the class; a registry built by code is not read (``unsupported``)."""
    method = (
        "    def _detect_parallelism_type(self, module):\n"
        "        module_type = type(module).__name__\n"
        "        if self._FUSED in module_type:\n"
        '            if self.megatron_param.endswith("layer_norm_weight"):\n'
        '                return "replicated"\n'
        '            return "column"\n'
        "        for parallelism, types in self._MODULE_TYPE_REGISTRY.items():\n"
        "            if module_type in types:\n"
        "                return parallelism\n"
        '        if module_type == "TELinear":\n'
        "            return module.parallel_mode\n"
    )
    literal = "{" + ", ".join(f"{k!r}: {{{', '.join(map(repr, sorted(v)))}}}" for k, v in TE_REGISTRY.items()) + "}"
    bodies = {
        "literal": f"    _MODULE_TYPE_REGISTRY: Dict[str, set] = {literal}\n",
        "built": "    _MODULE_TYPE_REGISTRY = f()\n",
    }
    static = bridge.PATCHES[0].static
    assert static is not None
    trees = {}
    for name, body in bodies.items():
        path = tmp_path / name / bridge.FILE
        path.parent.mkdir(parents=True)
        path.write_text(f'class AutoMapping(Base):\n    _FUSED = "LayerNormColumnParallelLinear"\n{body}{method}')
        trees[name] = UpstreamTree((tmp_path / name,), {"megatron-bridge": "9.9"})
    assert bridge._static_known(trees["literal"]) == bridge.Known(
        TE_REGISTRY, {"_FUSED": "LayerNormColumnParallelLinear"}
    )
    assert static.decide(trees["literal"]) == Verdict(
        "apply", f"AutoMapping knows 1 ({bridge.FUSED}) of MindSpeed's 9 TE classes"
    )
    assert bridge._static_known(trees["built"]) is None and static.decide(trees["built"]).action == "unsupported"
