"""Asynchronous copies with explicit completion events, the same API on CPU and CUDA.

CUDA: copies are issued on a side stream after it waits for the compute stream, and a
recorded event marks completion. CPU: one worker thread performs the copies and a future
marks completion. Either way the caller learns of completion only through `done()`/`wait()`,
so bookkeeping (commit, unpin) always happens on the caller's thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

CopyPairs = list[tuple[torch.Tensor, torch.Tensor]]  # (dst, src)


class Completion:
    def __init__(self, future: Future | None = None, event: "torch.cuda.Event | None" = None) -> None:
        self._future, self._event = future, event

    def done(self) -> bool:
        if self._event is not None:
            return bool(self._event.query())
        return self._future is None or self._future.done()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        elif self._future is not None:
            self._future.result()  # re-raises a failed copy on the caller's thread


def _copy_all(pairs: CopyPairs) -> None:
    for dst, src in pairs:
        dst.copy_(src)


class Copier:
    def __init__(self, device: str | torch.device, name: str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._pool = None
        else:
            self._stream = None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, pairs: CopyPairs) -> Completion:
        if self._stream is not None:
            ready = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                return Completion(event=self._stream.record_event())
        return Completion(future=self._pool.submit(_copy_all, pairs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
