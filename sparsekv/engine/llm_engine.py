"""The engine loop: validate requests, schedule, run, detokenize, and keep the run's figures."""
from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field

import torch

from sparsekv.engine.block_manager import BlockManager
from sparsekv.engine.model_runner import ModelRunner
from sparsekv.engine.overlap import OverlappedDecoder
from sparsekv.engine.scheduler import ScheduledBatch, Scheduler
from sparsekv.engine.sequence import Sequence
from sparsekv.kvcache.base import format_bytes
from sparsekv.models.spec import ModelSpec
from sparsekv.sampling_params import SamplingParams

GIB = 1 << 30
WARMUP_PROMPT_TOKENS = 19  # neither 1 nor a multiple of 16: the Triton specializations of a typical prompt length


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids
    text: str | None  # detokenized, when a tokenizer exists
    finish_reason: str | None


@dataclass
class RunStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    # decode step times: launch to completion; overlapped decode (engine/overlap.py): the previous step's completion
    # (or its own launch, if later) to its completion, i.e. the interval between consecutive steps
    step_seconds: list[float] = field(default_factory=list)
    step_batch_sizes: list[int] = field(default_factory=list)  # sequences decoded by each step of step_seconds

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0


class LLMEngine:
    def __init__(self, config, spec: ModelSpec, model, kv_store, tokenizer, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, policy):
        self.config, self.spec, self.model, self.kv_store = config, spec, model, kv_store
        self.tokenizer, self.device, self.dtype, self.policy = tokenizer, device, dtype, policy
        self.max_model_len = max_model_len
        # a sequence stops ("length") once it fills the whole KV pool, rather than failing the batch mid-run
        self.max_seq_len = min(max_model_len, kv_store.num_blocks * kv_store.block_size)
        self.block_manager = BlockManager(kv_store.num_blocks, kv_store.block_size)
        self.scheduler = Scheduler(self.block_manager, config.scheduler.max_num_seqs,
                                   kv_store.prefill_token_budget or config.scheduler.max_num_batched_tokens,
                                   kv_store.chunk_alignment)
        self.runner = ModelRunner(model, kv_store, device)
        eos = set(spec.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.stats = RunStats()
        self.graph_stats: dict = {"mode": "eager", "capture_seconds": 0.0, "batch_sizes": []}  # attach_graph_runner
        # start-up figures, seconds: weights, kv (build_engine), warmup (warm_up: kernels compiled, graphs captured)
        self.startup: dict[str, float] = {}
        # scheduler.async_decode: decode step N+1 is launched before step N's tokens are read (engine/overlap.py)
        overlap = getattr(config.scheduler, "async_decode", True) and kv_store.overlapped_decode_safe
        self.overlap = OverlappedDecoder(self.runner, self.scheduler, eos, self.max_seq_len, device) if overlap \
            else None

    # ---- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: pass a non-empty string or list of token ids")
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model.name} has no tokenizer: pass token-id lists, or a "
                                 "checkpoint directory with tokenizer files")
            return self.tokenizer.encode(prompt)
        # checks at C speed first (a 1M-token prompt); the per-token loops only find what to report
        if not isinstance(prompt, (list, tuple)) or not (set(map(type, prompt)) <= {int} or all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise TypeError(f"a prompt is a string or a list of int token ids; got {type(prompt).__name__} "
                            f"{str(prompt)[:60]}")
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: pass a non-empty string or list of token ids")
        if min(token_ids) < 0 or max(token_ids) >= self.spec.vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < self.spec.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})")
        return token_ids

    def check_fits(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {num_tokens} tokens but max_model_len is {self.max_model_len}, which "
                             "leaves no room to generate: shorten the prompt, or raise scheduler.max_model_len "
                             f"(the model's maximum is {self.spec.max_position_embeddings})")
        blocks = (num_tokens + self.kv_store.block_size - 1) // self.kv_store.block_size
        if blocks > self.kv_store.num_blocks:
            need = format_bytes(blocks * self.kv_store.bytes_per_block)
            have = format_bytes(self.kv_store.num_blocks * self.kv_store.bytes_per_block)
            raise ValueError(f"prompt of {num_tokens} tokens needs {need} of KV cache but only "
                             f"{have} is available: {self.kv_store.capacity_hint()}")

    def add_request(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_fits(len(token_ids))
        seq = Sequence(token_ids, params, self.kv_store.block_size)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop a request and return its blocks to the pool."""
        self.drain()
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        self.kv_store.release(seq)
        self.runner.sampler.forget(seq.seq_id)

    # ---- loop
    def step(self) -> list[Sequence]:
        """One step; returns the sequences that finished. With overlapped decode a decode step is launched and the
        in-flight one resolved (its sequences may finish) in the same call; see sparsekv/engine/overlap.py."""
        finished = []
        overlap = self.overlap
        if overlap is not None and overlap.busy:
            batch = self.scheduler.schedule_decode_ahead(self.max_seq_len)
            if batch is not None:
                previous = overlap.launch(batch)  # step N+1 runs behind step N on the device
                finished = self._resolve(previous)  # waits for step N only
                if not overlap.drop_if_discarded():
                    return finished
            else:
                finished = self.drain()
            if not self.scheduler.has_unfinished():
                return finished
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError("no sequence could be scheduled: the KV cache cannot hold even one; "
                               f"{self.kv_store.capacity_hint()}")
        if overlap is not None and not batch.is_prefill:
            overlap.launch(batch)
            return finished
        return finished + self._run_synchronously(batch)

    def drain(self) -> list[Sequence]:
        """Wait for the in-flight decode step, if any, and apply its tokens; returns the sequences that finished."""
        if self.overlap is None or not self.overlap.busy:
            return []
        return self._resolve(self.overlap.take())

    def _resolve(self, step) -> list[Sequence]:
        resolved = self.overlap.resolve(step)
        self.stats.decode_tokens += resolved.num_tokens
        self.stats.decode_steps += 1
        self.stats.decode_seconds += resolved.seconds
        self.stats.step_seconds.append(resolved.seconds)
        self.stats.step_batch_sizes.append(resolved.num_tokens)
        for seq in resolved.finished:
            self.release(seq)
        return resolved.finished

    def _run_synchronously(self, batch: ScheduledBatch) -> list[Sequence]:
        start = time.perf_counter()
        sampled = self.runner.run(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        if batch.is_prefill:
            self.stats.prompt_tokens += sum(batch.num_new_tokens)
            self.stats.prefill_seconds += elapsed
        else:
            self.stats.decode_tokens += len(batch.seqs)
            self.stats.decode_steps += 1
            self.stats.decode_seconds += elapsed
            self.stats.step_seconds.append(elapsed)
            self.stats.step_batch_sizes.append(len(batch.seqs))
        finished = self.scheduler.postprocess(batch, sampled, self.eos_ids, self.max_seq_len)
        for seq in finished:
            self.release(seq)
        return finished

    def reserve(self, num_tokens: int) -> float:
        """Allocate the KV memory of `num_tokens` tokens now (KVStore.reserve); returns the seconds spent."""
        return self.kv_store.reserve(num_tokens)

    def generate(self, prompts: list[str | list[int]] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 progress=None) -> list[RequestOutput]:
        token_lists, params_list = self.prepare_requests(prompts, sampling_params)
        return self.run_requests(token_lists, params_list, progress)

    def prepare_requests(self, prompts: list[str | list[int]] | str,
                         sampling_params: SamplingParams | list[SamplingParams] | None = None
                         ) -> tuple[list[list[int]], list[SamplingParams]]:
        """(token ids, params) of every prompt, each checked against the KV cache before any is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompt is empty: pass at least one prompt (a string or a list of token ids)")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in params_list):
            raise TypeError("sampling_params must be a SamplingParams or a list of them")
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        token_lists = [self.tokenize(p) for p in prompts]
        for token_ids in token_lists:  # every request is checked before any is queued
            self.check_fits(len(token_ids))
        return token_lists, list(params_list)

    def run_requests(self, token_lists: list[list[int]], params_list: list[SamplingParams],
                     progress=None) -> list[RequestOutput]:
        seqs = [self.add_request(t, p) for t, p in zip(token_lists, params_list)]
        if self.runner.graph_runner is not None:  # the decode sizes these requests can reach, before any timing
            self.runner.graph_runner.capture_up_to(len(self.scheduler.waiting) + len(self.scheduler.running))
        try:
            while self.scheduler.has_unfinished():
                self.step()
                if progress is not None:
                    progress(self)
        except BaseException:  # a failed step (a plugin's bad output, an interrupt): the requests leave, blocks freed
            for seq in seqs:
                with contextlib.suppress(Exception):  # the step's own error is the one to show
                    self.abort(seq)
            raise
        return [RequestOutput(i, seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids,
                              self.tokenizer.decode(seq.completion_token_ids) if self.tokenizer else None,
                              seq.finish_reason) for i, seq in enumerate(seqs)]

    def warm_up(self) -> float:
        """Two short requests, greedy and sampled (a prefill and a decode step each), so that kernels compile
        (Triton, cuBLAS, the sampler's) and batch size 1's decode graph is captured here rather than inside the first
        request's figures. The run's figures and counters are reset after it; returns its seconds
        (startup["warmup_seconds"])."""
        prompt = self._warm_up_prompt()
        if prompt is None:
            return 0.0
        captured = float(self.graph_stats.get("capture_seconds", 0.0))
        start = time.perf_counter()
        self.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        # and a sampled one: top-k / top-p / multinomial kernels load lazily on first use, which a CLI run
        # (sampled by default) would otherwise pay inside its prefill figure
        self.generate([prompt], SamplingParams(temperature=1.0, top_k=2, top_p=0.9, seed=0, max_tokens=2,
                                               ignore_eos=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.reset_figures()
        self.startup["warmup_seconds"] = seconds
        self.startup["warmup_capture_seconds"] = float(self.graph_stats.get("capture_seconds", 0.0)) - captured
        return seconds

    def warm_up_greedy(self) -> None:
        """The warm-up's greedy request alone, figures reset after it: what compile_kernels_ahead records (its
        kernels are the sampled request's too; the sampler is torch's)."""
        prompt = self._warm_up_prompt()
        if prompt is not None:
            self.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        self.reset_figures()

    def _warm_up_prompt(self) -> list[int] | None:
        num_tokens = min(WARMUP_PROMPT_TOKENS, self.max_seq_len - 2)
        if num_tokens < 1 or -(-num_tokens // self.kv_store.block_size) > self.kv_store.num_blocks:
            return None
        return [1 + i % (self.spec.vocab_size - 1) for i in range(num_tokens)]

    def reset_figures(self) -> None:
        """Zero the run's figures: timings, the policy's density, graph replay counts and the store's transfer
        counters (so what follows, a request or a task's cell, is measured on its own)."""
        self.stats = RunStats()
        self.policy.reset_density()
        graph = self.runner.graph_runner
        if graph is not None:
            graph.replayed_steps = graph.eager_steps = 0
        transfers = self.kv_store.transfer_stats  # the store's own counters (an empty dict for a resident store)
        for key in transfers:
            transfers[key] = 0

    def summary(self) -> dict[str, float]:
        """The run's figures in three parts: start-up (weights, KV allocation), compile (kernels: the kernels compiled
        ahead and the warm-up less its graph captures; graphs: every capture so far) and steady state (prefill tok/s,
        decode ms/token)."""
        graphs = float(self.graph_stats.get("capture_seconds", 0.0))
        warmup = self.startup.get("warmup_seconds", 0.0)
        kernels = max(0.0, warmup - self.startup.get("warmup_capture_seconds", 0.0)) + self.startup.get(
            "compile_ahead_seconds", 0.0)
        return {"weights_seconds": self.startup.get("weights_seconds", 0.0),
                "kv_seconds": self.startup.get("kv_seconds", 0.0),
                "compile_seconds": kernels + graphs, "kernel_compile_seconds": kernels,
                "graph_capture_seconds": graphs,
                "prefill_tok_s": self.stats.prefill_tok_s, "decode_ms_per_token": self.stats.decode_ms_per_step}

    # ---- figures
    def peak_memory(self) -> dict[str, float]:
        figures = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
        if self.device.type == "cuda":
            figures["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
        return figures
