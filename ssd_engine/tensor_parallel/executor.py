"""Rank 0's side of a tensor-parallel model, a ModelRunner to the engine; errors name the worker."""

import contextlib
import subprocess
import threading
from dataclasses import replace

import torch

from ssd_engine.distributed import supervise
from ssd_engine.distributed.comm import TPGroup
from ssd_engine.distributed.placement import unpin
from ssd_engine.runtime.model_runner import ModelRunner, RunnerSpec
from ssd_engine.runtime.step_inputs import StepInputs
from ssd_engine.tensor_parallel.worker import BlockTableMirror, step_message


class TensorParallelError(RuntimeError):
    pass


class TensorParallelRunner:
    def __init__(
        self, tp: TPGroup, runner_spec: RunnerSpec, processes: dict, restore_placement=None
    ) -> None:
        self.tp, self.processes = tp, processes  # rank -> subprocess.Popen (empty under torchrun)
        self._restore = restore_placement
        self.mirror = BlockTableMirror()
        self.freed: list[int] = []
        self.error: TensorParallelError | None = None
        self.closed = False
        self.in_step = False
        # every rank builds from the config read here, so no rank reads it differently
        runner_spec = runner_spec.for_other_processes()
        with self._guard("loading the model"):
            self.tp.send_command("init_runner", runner_spec)
            try:
                self.runner = runner_spec.build(tp)
            except BaseException:
                self.tp.barrier_status(True)  # the workers drop their shards and exit
                raise
            if self.tp.barrier_status(False):
                raise TensorParallelError(
                    "a tensor-parallel worker failed to load its shard (its traceback is above)"
                )

    @property
    def model(self):
        return self.runner.model

    @property
    def config(self):
        return self.runner.config

    @property
    def device(self):
        return self.runner.device

    @property
    def local(self) -> ModelRunner:
        return self.runner

    def forward(self, batch, logit_rows: list[list[int]], token_ids=None, on_device=None):
        inputs = StepInputs.from_batch(batch, logit_rows, token_ids, on_device)
        message = step_message([seq.seq_id for seq in batch.seqs], inputs, self.mirror, self.freed)
        self.freed = []
        with self._guard("a forward step"):
            self.in_step = (
                True  # still set if interrupted (Ctrl-C): workers then wait inside a collective
            )
            self.tp.send_command("forward", message)
            if inputs.on_device is not None:  # device-held drafts go device to device: no host read
                at, values = inputs.on_device
                values = self.tp.broadcast(values.to(self.device, torch.long).contiguous())
                inputs = replace(inputs, on_device=(at, values))
            logits = self.runner.run(inputs)
            self.in_step = False
            return logits

    def capture_graphs(self, keys: list[tuple]) -> None:
        # every rank captures: the graphs hold the all-reduces
        with self._guard("capturing CUDA graphs"):
            self.tp.send_command("capture_graphs", keys)
            self.runner.capture_graphs(keys)

    def release(self, seq) -> None:
        """The sequence's blocks were freed: workers drop their copy of its table with the next step."""
        self.mirror.forget(seq.seq_id)
        self.freed.append(seq.seq_id)

    @contextlib.contextmanager
    def _guard(self, what: str):
        if self.error is not None:
            raise self.error
        try:
            yield
        except RuntimeError as error:
            if isinstance(error, TensorParallelError):
                self.error = error
            else:
                self.error = TensorParallelError(
                    f"tensor parallelism failed during {what}: {self._diagnose()}; "
                    f"close this engine and start a new one ({error})"
                )
            raise self.error from error

    def _send_shutdown(self) -> None:
        try:
            self.tp.send_command("shutdown")
        except RuntimeError:
            pass  # a worker already gone; close() reaps it either way

    def _diagnose(self) -> str:
        dead = []
        for rank, process in self.processes.items():
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                continue
            dead.append(
                f"worker rank {rank} (pid {process.pid}) died with exit code {process.returncode}"
            )
        return "; ".join(dead) or "a collective failed or missed the distributed_timeout_s deadline"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.error is None and not self.in_step:
            # from a thread: a worker that is not listening must not block close(); terminate() below frees it
            sender = threading.Thread(target=self._send_shutdown, daemon=True)
            sender.start()
            sender.join(timeout=5.0)  # exiting while it still sends would abort the interpreter
        polite = 10.0 if self.error is None and not self.in_step else 0.0
        for process in self.processes.values():
            supervise.stop(process, exit_s=polite, term_s=3.0)
        if self._restore is not None:
            unpin(self._restore)
        self.runner = None
