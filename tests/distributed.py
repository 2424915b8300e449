"""Multi-rank test harness: N CPU processes in one gloo process group, started once, running many checks.

    group = GlooWorld(world_size=2)
    group.run(check, "colwise")      # check(rank, "colwise") on every rank; a list of per-rank results
    group.close()

``check`` is a module-level function of a test file. Each rank process imports that file by its
path (``--import-mode=importlib`` leaves test files unimportable by name) and calls it with a
:class:`Rank`: the 1-D tp mesh over all ranks plus helpers that compare a sharded module with its
unsharded twin; ``rank.context(tp_size=2, fsdp_size=2, ep_size=4)`` is the rank's
``raymoe.rank.context.RankContext`` of that layout (its dense and expert meshes),
built once per process and layout. An exception on any rank fails ``run`` with every failing
rank's traceback; ranks left waiting in a collective are killed after ``timeout_s`` and the group
restarts on the next run.

Rank processes run this file as a script (``python tests/distributed.py``), so the parent never
imports torch for them and nothing depends on how pytest imported the tests.
Set ``RAYMOE_DIFF_LOG=path`` to append every measured difference to ``path`` as JSON lines.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 120.0
FAILURE_GRACE_S = 3.0  # after one rank fails, how long the others get to report before they are killed


class GlooWorld:
    """Parent side: starts ``world_size`` rank processes on first use and runs functions on all of them."""

    def __init__(self, world_size: int, *, timeout_s: float = RUN_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(rank, *args)`` on every rank; per-rank return values in rank order."""
        if not self._conns:
            self._start()
        task = (str(Path(fn.__code__.co_filename).resolve()), fn.__qualname__, args)
        for conn in self._conns:
            conn.send(task)
        return self._collect()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a rank that already died
                conn.send(None)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs, self._conns = [], []
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def _start(self) -> None:
        self._workdir = tempfile.TemporaryDirectory(prefix="raymoe-ranks-")
        workdir = Path(self._workdir.name)
        authkey = secrets.token_bytes(16)
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            host, port = listener.address
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYMOE_RANK_AUTHKEY": authkey.hex()}
            for rank in range(self.world_size):
                log = (workdir / f"rank{rank}.log").open("wb")
                cmd = [sys.executable, __file__, f"--rank={rank}", f"--world-size={self.world_size}"]
                cmd += [f"--address={host}:{port}", f"--store={workdir / 'store'}"]
                self._procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            accepted = _accept(listener, self.world_size, START_TIMEOUT_S)
            if len(accepted) < self.world_size:
                self._fail(f"{self.world_size - len(accepted)} rank processes did not connect in time")
        conns = {conn.recv(): conn for conn in accepted}
        self._conns = [conns[rank] for rank in range(self.world_size)]
        self._collect()  # each rank reports once its process group and mesh are up

    def _collect(self) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout_s
        by_conn = {id(conn): rank for rank, conn in enumerate(self._conns)}
        pending = list(self._conns)
        while pending:
            ready = wait(pending, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for conn in ready:
                rank = by_conn[id(conn)]
                pending.remove(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", "the rank process exited"
                (results if status == "ok" else errors)[rank] = value
            if errors:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if errors or pending:
            stuck = sorted(by_conn[id(conn)] for conn in pending)
            self._fail(_failure_message(errors, stuck))
        return [results[rank] for rank in range(self.world_size)]

    def _fail(self, message: str) -> None:
        logs = self._log_tails()
        for proc in self._procs:
            proc.kill()
        self.close()
        raise AssertionError(f"{message}\n{logs}".rstrip())

    def _log_tails(self) -> str:
        if self._workdir is None:
            return ""
        tails = []
        for rank in range(self.world_size):
            path = Path(self._workdir.name) / f"rank{rank}.log"
            text = path.read_text(errors="replace")[-2000:] if path.exists() else ""
            if text.strip():
                tails.append(f"--- rank {rank} output (tail) ---\n{text}")
        return "\n".join(tails)


def _accept(listener: Listener, count: int, timeout_s: float) -> list[Connection]:
    """Up to ``count`` connections within ``timeout_s`` (``Listener.accept`` itself has no timeout)."""
    accepted: list[Connection] = []

    def accept_all() -> None:
        with contextlib.suppress(OSError):  # the listener closed under us: the caller gave up
            for _ in range(count):
                accepted.append(listener.accept())

    thread = threading.Thread(target=accept_all, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return list(accepted)


def _failure_message(errors: dict[int, str], stuck: list[int]) -> str:
    lines = [f"[rank {rank}] {text}" for rank, text in sorted(errors.items())]
    if stuck:
        lines.append(f"ranks {stuck} did not finish (killed; likely waiting in a collective)")
    return "\n".join(lines)


# --- rank side ---------------------------------------------------------------------------------


class Rank:
    """What a check function gets on each rank: the tp mesh and twin-comparison helpers."""

    FORWARD_ATOL = 1e-5
    GRAD_RTOL = 1e-5

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()

    def sharded_twin(self, model: Any, rules: dict[str, str], styles: Any = None) -> Any:
        """A deep copy of ``model`` with ``rules`` applied on this rank (``styles``: name -> instance,
        default the built-in styles)."""
        import copy

        from raymoe.parallel.apply import apply_rules

        twin = copy.deepcopy(model)
        apply_rules(twin, rules, self.mesh, styles)
        return twin

    def context(self, **config: Any) -> Any:
        """This rank's ``RankContext`` of ``DistributedConfig(**config)`` over all ranks; meshes built on first use.

        Building meshes creates process groups, so every rank must ask for the same layouts in the same order.
        """
        key = tuple(sorted(config.items()))
        if key not in _CONTEXTS:
            import torch

            from raymoe.rank.context import RankContext
            from raymoe.spec.config import DistributedConfig
            from raymoe.spec.topology import build_topology

            topology = build_topology(DistributedConfig(**config), self.world_size)
            ctx = RankContext(self.rank, self.world_size, torch.device("cpu"), "gloo")
            ctx.use_layout(topology)
            _CONTEXTS[key] = ctx
        return _CONTEXTS[key]

    def local_part(self, full: Any, dim: int) -> Any:
        """This rank's even chunk of ``full`` along ``dim``."""
        return full.chunk(self.world_size, dim=dim)[self.rank]

    def expect_close(self, what: str, got: Any, want: Any) -> float:
        """Forward outputs: max abs difference <= 1e-5."""
        return self._expect(what, got, want, relative=False, tolerance=self.FORWARD_ATOL)

    def expect_close_rel(self, what: str, got: Any, want: Any) -> float:
        """Gradients: max abs difference / max abs of ``want`` <= 1e-5."""
        return self._expect(what, got, want, relative=True, tolerance=self.GRAD_RTOL)

    def expect_close_norm(self, what: str, got: Any, want: Any) -> float:
        """Gradients, norm-based: ||got - want|| / ||want|| <= 1e-5 (an all-zero ``want`` needs ||got|| <= 1e-5)."""
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
        diff, scale = (got.detach() - want.detach()).norm().item(), want.detach().norm().item()
        measured = diff / scale if scale > 0 else diff
        _log_diff(what, measured, True)
        if not measured <= self.GRAD_RTOL:
            raise AssertionError(
                f"{what}: norm-relative difference {measured:.3g} > {self.GRAD_RTOL:g} on rank {self.rank}"
            )
        return float(measured)

    def expect_same_grads(self, sharded: Any, full: Any) -> None:
        """Every parameter of ``full`` has a gradient, and ``sharded``'s, gathered, matches it."""
        from torch.distributed.tensor import DTensor

        sharded_params = dict(sharded.named_parameters())
        for name, param in full.named_parameters():
            if not param.requires_grad:
                continue
            twin = sharded_params[name]
            assert param.grad is not None, f"{name}: the unsharded twin got no gradient; the test checks nothing"
            assert twin.grad is not None, f"{name}: no gradient on the sharded parameter"
            grad = twin.grad.full_tensor() if isinstance(twin.grad, DTensor) else twin.grad
            self.expect_close_rel(f"grad {name}", grad, param.grad)

    @staticmethod
    @contextlib.contextmanager
    def dispatched_ops() -> Iterator[list[Any]]:
        """Every op torch dispatches inside the block, in order (``OpOverload``s: ``op.name()`` is e.g.
        ``"c10d::allreduce_"``, ``op.overloadpacket.__name__`` ``"allreduce_"``)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        seen: list[Any] = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        with Record():
            yield seen

    @staticmethod
    def collectives(ops: list[Any]) -> list[str]:
        """The names of the collectives among ``ops`` (:meth:`dispatched_ops`), waits left out."""
        return [op.name() for op in ops if "c10d" in op.name() and "wait" not in op.name()]

    def _expect(self, what: str, got: Any, want: Any, *, relative: bool, tolerance: float) -> float:
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
        diff = (got.detach() - want.detach()).abs().max().item() if want.numel() else 0.0
        scale = want.detach().abs().max().item() if relative and want.numel() else 1.0
        measured = diff / scale if relative and scale > 0 else diff
        _log_diff(what, measured, relative)
        if not measured <= tolerance:
            kind = "relative" if relative else "max abs"
            raise AssertionError(f"{what}: {kind} difference {measured:.3g} > {tolerance:g} on rank {self.rank}")
        return float(measured)


def _log_diff(what: str, measured: float, relative: bool) -> None:
    path = os.environ.get("RAYMOE_DIFF_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": what, "diff": measured, "relative": relative, "test": _CURRENT[0]}) + "\n")


_CURRENT = [""]  # the check running on this rank, for the diff log
_CONTEXTS: dict[tuple[tuple[str, Any], ...], Any] = {}  # Rank.context's layouts, kept for the process's life


def _load(path: str, modules: dict[str, Any]) -> Any:
    if path not in modules:
        name = f"_rank_tests_{len(modules)}_{Path(path).stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[path] = module
    return modules[path]


def _serve(rank: int, world_size: int, address: str, store: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["RAYMOE_RANK_AUTHKEY"]))
    conn.send(rank)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    conn.send(("ok", None))
    modules: dict[str, Any] = {}
    while (task := conn.recv()) is not None:
        path, qualname, args = task
        _CURRENT[0] = qualname
        try:
            result = getattr(_load(path, modules), qualname)(Rank(mesh), *args)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--store", required=True)
    ns = parser.parse_args()
    _serve(ns.rank, ns.world_size, ns.address, ns.store)
