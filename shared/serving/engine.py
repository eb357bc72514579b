"""LLMEngine: config -> runner decision -> runner -> KV cache -> graphs; then steps.

One process, one device. A step is schedule, execute, sample, update; synchronously, or
with async scheduling (V2) step N+1 is launched before step N's update. V2's async output
object is resolved when the update needs it (its copy has overlapped the runner's
post-processing by then). The engine installs its KernelOptions around its set-up and
each step, and rolls a failed step back (`_recover_from_failed_step`).
"""

from __future__ import annotations

import importlib
import logging
import random
import time
from collections.abc import Iterable
from typing import Any

import torch

from policy.config import EngineConfig
from policy.logits_processors import load_class
from shared.contract.outputs import RequestOutput, SpecDecodeStats
from shared.contract.pooling import PoolingParams
from shared.contract.sampling_params import RequestOutputKind, SamplingParams
from shared.contract.step import SchedulerOutput
from shared.distributed.init import torchrun_env
from shared.runtime.kernel_options import use_kernel_options
from shared.serving.admission import (  # noqa: F401 (re-exported: the engine's API)
    MAX_MIN_TOKENS_STOP_IDS,
    POOLING_PLACEHOLDER_PARAMS,
    EngineInputError,
    validate_params,
    validate_pooling_params,
    validate_prompt,
)
from shared.serving.detokenizer import IncrementalDetokenizer, decode_token
from shared.serving.parallel_sampling import ParentRequest, child_params
from shared.serving.request import Request
from shared.serving.request_output import reports, request_output
from shared.serving.scheduler import Scheduler
from shared.serving.tp_worker import run_worker_from_torchrun
from shared.serving.tp_workers import start_tp_runner

logger = logging.getLogger("runnerlab")

def is_torchrun_worker() -> bool:
    """Launched by torchrun, as a rank other than 0."""
    env = torchrun_env()
    return env is not None and env[0] != 0


def resolve_runner_class(path: str) -> type:
    """'package.module:Class' -> the class. The engine reaches runners only this way."""
    module_name, _, cls_name = path.partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.decision = config.runner_decision
        self.runner_name: str = self.decision.runner
        self.device = torch.device(config.device_config.device)
        self.model_config = config.model_config
        self.max_model_len = config.scheduler_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        torch.manual_seed(config.load_config.seed)
        # This engine's kernel options, installed around its set-up (the graphs captured
        # here keep them) and around each step (`step`).
        self.kernel_options = config.kernel_options
        spec = config.speculative_config
        self.num_speculative_tokens = 0 if spec is None else spec.num_speculative_tokens
        # A draft model writes its KV up to k - 1 positions past the request's last token
        # before the next schedule allocates them: the scheduler allocates that far ahead.
        self.num_lookahead_tokens = (
            self.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        )
        with use_kernel_options(self.kernel_options):
            num_blocks = self._set_up_runner(config)

        sc, cc = config.scheduler_config, config.cache_config
        self.scheduler = Scheduler(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=sc.max_model_len,
            num_blocks=num_blocks,
            block_size=cc.block_size,
            enable_prefix_caching=cc.enable_prefix_caching,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            async_scheduling=sc.async_scheduling,
            num_speculative_tokens=self.num_speculative_tokens,
            num_lookahead_tokens=self.num_lookahead_tokens,
            drafts_on_device=getattr(self.runner, "keeps_drafts_on_device", False),
        )
        self.async_scheduling = sc.async_scheduling
        if self.async_scheduling and not getattr(self.runner, "supports_async_scheduling", False):
            raise ValueError(  # the policy's feature gate refuses this first
                f"async_scheduling=True is not supported by the {self.runner_name} runner; "
                "use model_runner='v2' or async_scheduling=False"
            )
        # Async scheduling: the step launched last, whose output is still in flight.
        self._pending: tuple[SchedulerOutput, Any] | None = None
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._arrivals = 0
        self._seed_rng = random.Random(config.load_config.seed)
        # Summed over finished requests (each request's own counters are in its output).
        self.spec_decode_stats = SpecDecodeStats()
        # n > 1: parent id -> its samples' collector; child id -> (parent, sample index)
        self._parents: dict[str, ParentRequest] = {}
        self._child_of: dict[str, tuple[ParentRequest, int]] = {}
        # custom logits processors: their classes' admission checks (validate_params)
        self._processor_classes = [load_class(s) for s in config.logits_processors]
        self.scheduler.decode_token = self._decode_token
        # a pooling engine (one task for every request): prompts are pooled, not continued
        self.pooling_task: str | None = getattr(config, "pooling_task", None)

    def _set_up_runner(self, config: Any) -> int:
        """Runner, weights, KV cache, CUDA graphs; returns the number of KV blocks."""
        start = time.perf_counter()
        runner_cls = resolve_runner_class(self.decision.runner_class)
        if config.parallel_config.tensor_parallel_size > 1 or torchrun_env() is not None:
            # rank 0 of a group: spawns (or, under torchrun, joins) the other ranks; the
            # runner it returns sends each call to every rank (shared/serving/tp_runner.py)
            self.runner = start_tp_runner(config, self.device, runner_cls)
        else:
            self.runner = runner_cls(config, self.device)
        try:
            return self._set_up_weights_and_cache(start)
        except BaseException:
            self.shutdown()  # no worker outlives a failed set-up
            raise

    def _set_up_weights_and_cache(self, start: float) -> int:
        self.runner.load_model()
        num_blocks = self.runner.determine_num_blocks()
        self._check_kv_fits_one_request(num_blocks)
        self.runner.initialize_kv_cache(num_blocks)
        self.startup_s = time.perf_counter() - start
        start = time.perf_counter()
        self.runner.capture_model()
        self.capture_s = time.perf_counter() - start
        return num_blocks

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """The engine of `engine_args`; under torchrun, on a rank other than 0, this rank
        serves rank 0's runner instead and exits when rank 0 shuts down (SystemExit(0)):
        the policy decides once, on rank 0, so no configuration is resolved here."""
        if is_torchrun_worker():
            from policy.config import resolve_device
            from policy.parallel import ParallelConfig

            run_worker_from_torchrun(
                ParallelConfig(tensor_parallel_size=engine_args.tensor_parallel_size,
                               distributed_timeout_s=engine_args.distributed_timeout_s),
                resolve_device(engine_args.device))
            raise SystemExit(0)
        return cls(engine_args.create_engine_config())

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at exit)."""
        shutdown = getattr(getattr(self, "runner", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- tokenizer ------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if not self._tokenizer_loaded:
            from shared.serving.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_config)
            self._tokenizer_loaded = True
        return self._tokenizer

    @property
    def _model_name(self) -> str:
        return str(self.model_config.preset or self.model_config.model_dir)

    def _decode_token(self, token_id: int) -> str | None:
        """A logprobs entry's text (None without a tokenizer)."""
        tokenizer = self.tokenizer
        return None if tokenizer is None else decode_token(tokenizer, token_id)

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int],
        sampling_params: SamplingParams | PoolingParams | None,
    ) -> None:
        """Queue one request (n > 1: its n samples; PoolingParams on a pooling engine). A
        bad request raises EngineInputError before anything is queued, so the requests
        already in flight are untouched."""
        if not isinstance(request_id, str):
            raise EngineInputError(
                f"request id {request_id!r} is a {type(request_id).__name__}; pass a str"
            )
        prompt_token_ids = self._validate_prompt(request_id, prompt_token_ids)
        if self.pooling_task is not None or isinstance(sampling_params, PoolingParams):
            pooling = validate_pooling_params(request_id, sampling_params, self.pooling_task)
            self._check_id_free(request_id)
            self._queue(request_id, prompt_token_ids, POOLING_PLACEHOLDER_PARAMS, pooling)
            return
        params = self._validate_params(request_id, sampling_params)
        if params.seed is None:
            # Every request gets a seed at admission, so its random stream is a pure
            # function of (seed, position, vocab id) in both runners.
            params.seed = self._seed_rng.randrange(2**63)
        if params.n == 1:
            self._check_id_free(request_id)
            self._queue(request_id, prompt_token_ids, params)
            return
        parent = ParentRequest(request_id, params.n, params.output_kind)
        for rid in (request_id, *parent.child_ids):
            self._check_id_free(rid)
        self._parents[request_id] = parent
        for i, child_id in enumerate(parent.child_ids):
            self._child_of[child_id] = (parent, i)
            self._queue(child_id, prompt_token_ids, child_params(params, i))

    def _check_id_free(self, request_id: str) -> None:
        if (request_id in self.scheduler.requests or request_id in self._parents
                or request_id in self._child_of):
            raise EngineInputError(
                f"request id {request_id!r} is already in use by a running or waiting request "
                "(or one of its n samples); use a new id, or abort_request() the first one "
                "before resubmitting"
            )

    def _queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               pooling: PoolingParams | None = None) -> None:
        request = Request(request_id, prompt_token_ids, params, self.eos_token_id, self._arrivals)
        request.pooling_params = pooling
        # Stop strings are matched on the text as it grows; an output that reports text
        # every step (CUMULATIVE, DELTA) grows it a token at a time too, rather than
        # decoding the whole output again at each step (O(length) a step). FINAL_ONLY
        # decodes once, when the request finishes (shared/serving/request_output.py).
        if params.stop or (self.tokenizer is not None
                           and params.output_kind is not RequestOutputKind.FINAL_ONLY):
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self._arrivals += 1
        self.scheduler.add_request(request)

    def _validate_prompt(self, request_id: str, prompt: Any) -> list[int]:
        return validate_prompt(request_id, prompt, self.max_model_len, self.vocab_size)

    def _validate_params(self, request_id: str, sampling_params: Any) -> SamplingParams:
        return validate_params(request_id, sampling_params, self)

    def abort_request(self, request_ids: Iterable[str] | str) -> None:
        """Abort requests by id; a parent id (n > 1) aborts all of its samples."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ids: list[str] = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            ids.extend(parent.child_ids if parent is not None else [rid])
        self.scheduler.abort_requests(ids)

    def num_output_tokens(self, request_id: str) -> int | None:
        """Tokens a live request has generated so far; None once it has finished (or for
        an unknown id). Lets a caller whose requests report FINAL_ONLY follow them."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None else len(req.output_token_ids)

    def has_unfinished_requests(self) -> bool:
        # Finished-but-unreported requests (aborts) count: the next step tells the runner
        # and reports them.
        return (
            self.scheduler.has_unfinished_requests()
            or self.scheduler.has_finished_requests()
            or self._pending is not None
        )

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def num_free_kv_blocks(self) -> int:
        return self.scheduler.num_free_blocks

    def num_total_kv_blocks(self) -> int:
        return self.scheduler.num_total_blocks

    # ---- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. Exception-safe: when anything in it raises (KeyboardInterrupt
        included), the scheduler and the runner are rolled back to a consistent state
        before the exception propagates (`_recover_from_failed_step`), so the next step
        is correct and no request is lost."""
        try:
            with use_kernel_options(self.kernel_options):
                return self._step()
        except BaseException:
            self._recover_from_failed_step()
            raise

    def _recover_from_failed_step(self) -> None:
        """Drop the steps in flight, requeue every running request for a recompute from
        its confirmed tokens (the scheduler's recovery) and make the runner forget every
        request. Seeded sampling makes the recomputed tokens the ones the failed step
        would have produced."""
        self._pending = None
        requeued = self.scheduler.recover_from_failed_step()
        self.runner.reset_request_states()
        logger.warning(
            "A step failed; %d running request(s) requeued for recompute, the prefix cache "
            "emptied and the %s runner's request state reset.", requeued, self.runner_name,
        )

    def _step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self.runner.execute_model(scheduler_output)
        runner_output = self.runner.sample_tokens(None)
        if not self.async_scheduling:
            return self._finish_step(scheduler_output, runner_output)
        # Async: step N+1 is on the GPU before step N's tokens are read back; reading
        # them (and the scheduler's bookkeeping) overlaps step N+1's forward.
        pending, self._pending = self._pending, None
        outputs = [] if pending is None else self._finish_step(*pending)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # nothing runs: settle it now rather than keep an empty step in flight
            outputs += self._finish_step(scheduler_output, runner_output)
        else:
            self._pending = (scheduler_output, runner_output)
        return outputs

    def _finish_step(self, scheduler_output: SchedulerOutput, runner_output: Any) -> list[RequestOutput]:
        if hasattr(runner_output, "get_output"):
            runner_output = runner_output.get_output()
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.num_speculative_tokens:
            for update in updates:
                if update.finished:
                    self.spec_decode_stats.merge(update.request.spec_decode_stats)
        # each request's SamplingParams.output_kind says whether this step returns it
        outputs = [request_output(u, self.tokenizer, bool(self.num_speculative_tokens))
                   for u in updates if reports(u)]
        return self._gather_samples(outputs) if self._parents else outputs

    def _gather_samples(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The children's outputs (n > 1) become their parent's: one output per parent that
        advanced (streaming) or finished (not streaming)."""
        result, touched = [], {}
        for out in outputs:
            child = self._child_of.get(out.request_id)
            if child is None:
                result.append(out)
                continue
            parent, index = child
            parent.record(index, out)
            if out.finished:
                del self._child_of[out.request_id]
            touched.setdefault(parent.request_id, (parent, []))[1].append(index)
        for parent, indices in touched.values():
            if parent.finished:
                del self._parents[parent.request_id]
            if parent.output_kind is RequestOutputKind.DELTA:
                result.append(parent.output(indices))  # only the samples this step added to
            elif parent.finished or parent.output_kind is RequestOutputKind.CUMULATIVE:
                result.append(parent.output())
        return result

    @property
    def step_stats(self):
        return self.runner.step_stats

    def _check_kv_fits_one_request(self, num_blocks: int) -> None:
        block_size = self.config.cache_config.block_size
        needed = -(-self.max_model_len // block_size)
        if num_blocks < needed:
            # Only advice that works on this device: the CPU sizes its KV cache without
            # gpu_memory_utilization, so raising it there would change nothing.
            knobs = "num_gpu_blocks_override"
            if self.device.type == "cuda":
                knobs = "gpu_memory_utilization or num_gpu_blocks_override"
            raise EngineInputError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens, fewer than the "
                f"{needed} blocks one request of max_model_len={self.max_model_len} needs; raise "
                f"{knobs} or lower max_model_len"
            )
