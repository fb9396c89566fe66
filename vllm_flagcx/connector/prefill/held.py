"""Prefill's scheduler half: the requests whose KV it holds for a decode, one request per
transfer id (a second request under a held id would let decode pull the first one's KV),
from ``request_finished`` until vLLM reports the send finished. The worker's side of the
same transfers is ``sends.Sends``.

Single-threaded: vLLM's scheduler calls in.
"""

from __future__ import annotations

from vllm_flagcx.connector.common.metadata import RequestId, SendTask
from vllm_flagcx.wire.params import TransferId


class HeldSends:
    def __init__(self) -> None:
        self._tasks: dict[RequestId, SendTask] = {}
        self._transfer_ids: set[TransferId] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def holds(self, transfer_id: TransferId) -> bool:
        return transfer_id in self._transfer_ids

    def hold(self, task: SendTask) -> None:
        self._tasks[task.request_id] = task
        self._transfer_ids.add(task.transfer_id)

    def sent(self, request_id: RequestId) -> None:
        """vLLM reported the send finished (pulled, released or expired)."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            self._transfer_ids.discard(task.transfer_id)
