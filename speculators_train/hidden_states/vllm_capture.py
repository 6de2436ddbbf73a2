"""Hidden states from vLLM (`generation.engine: vllm`): the target runs in vLLM, not in this process.

vLLM's `extract_hidden_states` speculative method stores the residual stream at the layers its draft config names
(`eagle_aux_hidden_state_layer_ids`, counted as ours: id k is the stream after k decoder layers), and a KV-transfer
connector (`vllm_connector.py`) writes each finished request's rows to a file. Each sample's whole token sequence is
sent as one prompt asking for one token, so the rows cover every position the transformers capture covers. The
final pre-norm state is id N (after the last layer), which vLLM captures before its final norm.

A big target is split over `generation.tensor_parallel_size` GPUs by vLLM; each rank of a launcher runs its own
engine on its own GPUs, so ranks multiply data parallelism and vLLM supplies the tensor parallelism.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from speculators_train.errors import UserError
from speculators_train.origin import resolve_origin
from speculators_train.recipe import Recipe
from speculators_train.target import StateSpec, Target, resolve_device, resolve_dtype

CONNECTOR = "HiddenStatesConnector"
CONNECTOR_MODULE = "speculators_train.hidden_states.vllm_connector"
# A launcher's variables describe this process's group; vLLM's engine is a lone process of its own and would read
# them as its own rank (which GPU, which rendezvous).
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _rank_gpus(local_rank: int, per_rank: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for this rank's engine: its `per_rank` GPUs of those the launcher left visible."""
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    mine = devices[local_rank * per_rank : (local_rank + 1) * per_rank]
    if len(mine) < per_rank:
        raise UserError(
            f"generation.tensor_parallel_size {per_rank}: local rank {local_rank} needs GPUs "
            f"{local_rank * per_rank}..{(local_rank + 1) * per_rank - 1}, and {len(devices)} are visible; launch "
            f"{len(devices) // per_rank or 1} processes per machine"
        )
    return ",".join(mine)


class VllmCapture:
    """One vLLM engine on the target's HF folder for this rank, opened once for all of its chunks."""

    def __init__(self, recipe: Recipe, target: Target, rank: int, local_rank: int) -> None:
        # absolute: vLLM's workers write there from their own working directory
        self.spool = (recipe.hidden_states_dir / f".vllm-rank{rank:03d}").resolve()
        # The layers are the recipe's; a family that reads fewer takes a subset of what is captured.
        self.layer_ids = [*target.aux_layer_ids, target.num_layers]
        device = resolve_device(recipe.target.device)
        gen, regen = recipe.generation, recipe.data.regenerate
        environment: dict[str, str | None] = dict.fromkeys(LAUNCHER_VARIABLES)
        gpus = _rank_gpus(local_rank, gen.tensor_parallel_size)
        if gpus is not None:
            environment["CUDA_VISIBLE_DEVICES"] = gpus
        share = 0.45 if device.type == "cuda" and regen.enabled and regen.engine == "vllm" else None
        from speculators_train.engines.vllm.offline import Engine

        self.engine = Engine(
            Path(resolve_origin(recipe.target)[0]),
            {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}},
            },
            dtype=DTYPE_NAMES[resolve_dtype(recipe.target.dtype, device)],
            max_model_len=recipe.data.max_length + 1,  # the sample and the one token asked for
            kv_cache_gib=2,
            seed=recipe.seed,
            gpu_memory_utilization=share,
            environment=environment,
            # a cached prefix is not run again, so its states would not be captured
            enable_prefix_caching=False,
            tensor_parallel_size=gen.tensor_parallel_size,
            kv_transfer_config={
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.spool)},
            },
        )

    def __enter__(self) -> VllmCapture:
        shutil.rmtree(self.spool, ignore_errors=True)  # files of a killed run
        self.spool.mkdir(parents=True)
        self.engine.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.close()
        shutil.rmtree(self.spool, ignore_errors=True)

    def capture(self, samples: list, dtype: torch.dtype, spec: StateSpec) -> list[dict[str, Any]]:
        """What `pipeline.capture` returns for `samples`, from vLLM: the aux states of `spec` and, unless it says
        not, the final state, in `dtype` on CPU."""
        from vllm import SamplingParams

        if not samples:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        prompts = [{"prompt_token_ids": s.input_ids.tolist()} for s in samples]
        outputs = self.engine.llm.generate(prompts, params, use_tqdm=False)
        columns = [self.layer_ids.index(i) for i in spec.aux_layer_ids]
        out = []
        for sample, output in zip(samples, outputs, strict=True):
            states = self._read(output)
            if not torch.equal(states["token_ids"].to(torch.int64), sample.input_ids):
                raise UserError(f"vLLM captured other tokens than record {sample.id!r} holds")
            rows = states["hidden_states"]  # [T, len(layer_ids), H]
            item: dict[str, Any] = {
                "id": sample.id,
                "record": sample.record,
                "input_ids": sample.input_ids,
                "loss_mask": sample.loss_mask,
            }
            if columns:
                item["aux_hidden_states"] = rows[:, columns].reshape(len(rows), -1).to(dtype)
            if spec.final:
                item["hidden_state"] = rows[:, -1].to(dtype)
            out.append(item)
        return out

    def _read(self, output) -> dict[str, torch.Tensor]:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        path = (output.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise UserError(f"vLLM returned no hidden states for a request (its connector is not {CONNECTOR})")
        states = load_hidden_states(path)  # safetensors, after waiting on the file's lock for the write
        cleanup_hidden_states(path)
        return states
