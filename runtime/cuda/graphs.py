"""Runtime stage: CUDA graph capture of a stream's launches, instantiation, and replay.

The decode step is dozens of kernel launches; issued from Python each costs microseconds. Captured once into
a graph and replayed with one `cuGraphLaunch`, the step's host cost is a single call. Everything a captured
step reads (the position, the last token) therefore lives in device memory, never in launch arguments.
"""

from __future__ import annotations

from typing import Any, Callable

from ..backend import BackendError
from .device import Stream, check, driver


class CudaGraph:
    """An instantiated graph; `replay(stream)` launches it. Build with `CudaGraph.capture(stream, body)`."""

    def __init__(self, graph: Any, exec_: Any, name: str) -> None:
        self._graph, self._exec, self.name = graph, exec_, name

    @classmethod
    def capture(cls, stream: Stream, body: Callable[[], None], name: str = "graph") -> "CudaGraph":
        """Run `body()` (which launches onto `stream`) under stream capture and instantiate the result.

        Thread-local capture mode: other threads' CUDA calls stay legal, and an illegal call inside `body`
        (a synchronous copy, an allocation) fails loudly instead of silently leaving the graph.
        """
        cu = driver()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(stream.handle, mode), f"begin capture of {name}")
        try:
            body()
        except BaseException:
            # End the capture so the stream is usable again, then surface the body's error.
            ret = cu.cuStreamEndCapture(stream.handle)
            if isinstance(ret, tuple) and len(ret) > 1 and int(ret[0]) == 0 and ret[1] is not None:
                cu.cuGraphDestroy(ret[1])
            raise
        graph = check(cu.cuStreamEndCapture(stream.handle), f"end capture of {name}")
        try:
            exec_ = check(cu.cuGraphInstantiate(graph, 0), f"instantiate {name}")
        except BackendError:
            cu.cuGraphDestroy(graph)
            raise
        out = cls(graph, exec_, name)
        # Upload once now, so the first replay does not pay the graph's setup cost inside a timed region.
        check(cu.cuGraphUpload(exec_, stream.handle), f"upload {name}")
        return out

    def replay(self, stream: Stream) -> None:
        if self._exec is None:
            raise BackendError(f"CUDA graph {self.name} was destroyed")
        check(driver().cuGraphLaunch(self._exec, stream.handle), f"launch {self.name}")

    def destroy(self) -> None:
        cu = driver()
        if self._exec is not None:
            check(cu.cuGraphExecDestroy(self._exec), f"destroy {self.name}")
            self._exec = None
        if self._graph is not None:
            check(cu.cuGraphDestroy(self._graph), f"destroy {self.name}")
            self._graph = None
