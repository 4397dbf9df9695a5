"""Run a split graph's partitions as a DAG: host partitions on a worker thread, device ones here.

torch.fx executes a graph in order on one thread (``GraphModule.forward``, ``Interpreter``); it
has no notion of running independent subgraphs at once, so this small scheduler is ours. The
calling thread issues accelerator partitions (their kernels run asynchronously on the device
stream anyway) while CPU partitions run on one worker thread; so an accelerator partition and a
host partition that do not depend on each other overlap (the reference design's "subgraphs on
different hardware with no dependency execute in parallel"). A host partition with nothing to
overlap runs right here, without the hop to the worker; a plan on one device runs straight
through in a precomputed order. Backward needs nothing from us: autograd's engine already runs
CPU and device backward work on separate threads. The worker takes over the caller's grad mode,
current device, stream and autocast state for each partition (:mod:`foundation.thread_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from threading import Lock
from typing import Any

import torch
from torch import fx

from foundation import thread_state
from hetero.placement.plan import Plan


class PartitionRunner:
    """Executes the top-level graph of a split module with CPU partitions off-thread."""

    _pool: ThreadPoolExecutor | None = None  # one host worker shared by every placed model
    _pool_lock = Lock()

    def __init__(self, split_gm: fx.GraphModule, plan: Plan) -> None:
        self.split_gm = split_gm
        self.devices = {p.name: p.device for p in plan}  # submodule name -> logical device
        nodes = list(split_gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        # The tensors get_attr fetches are the model's own objects (moving them swaps ``.data``,
        # never the object), so they are looked up once, not on every call.
        self.attrs = {n: fx.graph_module._get_attr(split_gm, n.target)
                      for n in nodes if n.op == "get_attr"}
        self.output = next(n for n in nodes if n.op == "output")
        self.concurrent = len(set(self.devices.values())) > 1
        # What each call waits for: its inputs, and for a partition the partitions the plan puts
        # before it (in-place writes order partitions beyond their data, see mutation.py).
        call = {n.target: n for n in nodes if n.op == "call_module"}
        after = {call[p.name]: {call[plan[d].name] for d in p.depends_on} for p in plan}
        calls = [n for n in nodes if n.op in ("call_module", "call_function")]
        self.waits_for = {n: {i for i in n.all_input_nodes if i in after or i.op == "call_function"}
                          | after.get(n, set()) for n in calls}
        self.order = self._topological(calls, {p.name: p.index for p in plan})

    def _topological(self, calls: list[fx.Node], index: dict[str, int]) -> list[fx.Node]:
        """Calls in an order that honours ``waits_for``, partitions in plan order."""
        order: list[fx.Node] = []
        done: set[fx.Node] = set()
        pending = sorted(calls, key=lambda n: index.get(n.target, -1))
        while pending:
            node = next(n for n in pending if self.waits_for[n] <= done)
            pending.remove(node)
            order.append(node)
            done.add(node)
        return order

    @classmethod
    def _worker(cls) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetero-host")
            return cls._pool

    def _bind(self, node: fx.Node, env: dict[fx.Node, Any]) -> Callable[[], Any]:
        """The node's work with its arguments looked up now, on the scheduling thread."""
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_module":
            return partial(self.split_gm.get_submodule(node.target), *args, **kwargs)
        if node.op == "call_function":
            return partial(node.target, *args, **kwargs)
        raise RuntimeError(f"unexpected node {node.op} {node.target} in a split graph")

    @staticmethod
    def _on_worker(fn: Callable[[], Any], grad: bool, inference: bool,
                   state: thread_state.ThreadState) -> Any:
        # Grad and inference mode, the current device, its stream and autocast are thread-local:
        # carry the caller's into the worker (a fresh thread would issue to device 0).
        with (torch.inference_mode(inference), torch.set_grad_enabled(grad),
              thread_state.applied(state)):
            return fn()

    def _is_host(self, node: fx.Node) -> bool:
        return node.op == "call_module" and self.devices[node.target] == "cpu"

    def run(self, flat_inputs: list[Any]) -> Any:
        """Run every partition once; return what the graph's output node returns."""
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, flat_inputs, strict=True))
        env.update(self.attrs)
        if self.concurrent:
            self._run_concurrently(env)
        else:
            for node in self.order:
                env[node] = self._bind(node, env)()
        return fx.node.map_arg(self.output.args[0], env.__getitem__)

    def _run_concurrently(self, env: dict[fx.Node, Any]) -> None:
        pending = list(self.order)
        in_flight: dict[Future, fx.Node] = {}
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        state = thread_state.capture()
        try:
            while pending:
                ready = [n for n in pending if all(d in env for d in self.waits_for[n])]
                host = [n for n in ready if self._is_host(n)]
                local = [n for n in ready if not self._is_host(n)]
                if host and not local and not in_flight:
                    local, host = host[:1], []  # nothing to overlap: no hop to the worker
                for node in host:  # hand every ready host partition to the worker first
                    pending.remove(node)
                    work = self._bind(node, env)
                    future = self._worker().submit(self._on_worker, work, grad, inference, state)
                    in_flight[future] = node
                if local:  # then run one call here and look again
                    pending.remove(local[0])
                    env[local[0]] = self._bind(local[0], env)()
                elif in_flight:
                    done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                    for future in done:
                        env[in_flight.pop(future)] = future.result()
                else:
                    raise RuntimeError("placed graph cannot make progress (cyclic partitions)")
            for future in list(in_flight):
                env[in_flight.pop(future)] = future.result()
        finally:
            wait(in_flight)  # never leave host work running after an error
