"""vLLM's hidden-states connector, made to run on CPU workers too.

`generation.engine: vllm` captures states with vLLM's `extract_hidden_states` method: the target's forward stores
the residual stream at the requested layers in a cache of its own, and a KV-transfer connector writes each finished
request's rows to a safetensors file. vLLM's `ExampleHiddenStatesConnector` copies them out on a CUDA stream into
pinned memory and writes from a thread pool, which a CPU worker cannot do. On CPU this subclass copies and writes in
the worker's step instead, then reports the request done as the parent does once its copy event fires; the client
still waits on the file's lock before reading, as with the parent. On CUDA it is vLLM's connector unchanged.

vLLM imports this module inside its worker processes (`kv_connector_module_path`); this package never imports it.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """In place of the parent's CUDA copy event: a synchronous write is complete once it is recorded."""

    @staticmethod
    def query() -> bool:
        return True


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            partial = pending.filename + ".partial"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, partial)
            os.replace(partial, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the client waiting on the lock
        self._req_copy_events[pending.req_id] = _Written()
