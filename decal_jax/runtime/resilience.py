"""What keeps a long run alive: preemption (SIGTERM, Ctrl-C) and the non-finite loss guard.

- `PreemptionWatcher`: SIGTERM (what a cluster scheduler, a TPU maintenance event or
  `kill` sends before it takes the machine) and a first Ctrl-C (SIGINT) only set a flag;
  the trainer finishes the step it is in, saves a checkpoint and returns. A second Ctrl-C
  aborts at once (KeyboardInterrupt), losing only the steps since the last checkpoint.
  With several processes they agree on the step to stop at, so every host saves the same
  checkpoint.
- `NonFiniteGuard`: the jitted train step leaves params and optimizer state untouched when
  the loss or the gradient norm is NaN / Inf and reports it; the guard collects those
  reports without a device sync per step and, before anything is logged or saved, either
  raises (naming the step) or notes the skipped steps.
- `explain_out_of_memory`: XLA's RESOURCE_EXHAUSTED in a train step (or infer's decoding)
  becomes an `OutOfMemoryError` naming the batch's shapes and the bindings that set them.
"""
import contextlib
import signal
import threading
from typing import Any, Iterator, List, Mapping, Optional, Tuple

import jax
import numpy as np

NONFINITE_POLICIES = ("raise", "skip")


class NonFiniteError(FloatingPointError):
  """The loss or a gradient was NaN / Inf; nothing after it was saved."""


class NonFiniteGuard:
  """Host side of the non-finite check: `add` each step's device flag, `check` at sync points.

  Args:
    policy: 'raise' stops training at the first non-finite step (the latest checkpoint is
      from before it); 'skip' keeps training without those steps' updates.
  """

  def __init__(self, policy: str = "raise"):
    if policy not in NONFINITE_POLICIES:
      raise ValueError(f"nonfinite_policy must be one of {NONFINITE_POLICIES}, got {policy!r}.")
    self.policy = policy
    self._pending: List[Tuple[int, jax.Array]] = []
    self.skipped: List[int] = []

  def add(self, step: int, flag) -> None:
    """`flag`: the step's device scalar, 1 when its loss or gradient norm was not finite."""
    self._pending.append((step, flag))

  def check(self, last_checkpoint: Optional[int], model_dir: str) -> None:
    """Fetches the pending flags (one sync); raises or records the bad steps."""
    if not self._pending:
      return
    steps = [s for s, _ in self._pending]
    flags = jax.device_get([f for _, f in self._pending])
    self._pending = []
    bad = [s for s, f in zip(steps, flags) if int(f)]
    if not bad:
      return
    if self.policy == "skip":
      self.skipped += bad
      if jax.process_index() == 0:
        print(f"\nnote: step(s) {bad}: the loss or a gradient was NaN / Inf; those updates "
              f"were skipped ({len(self.skipped)} skipped in this run).", flush=True)
      return
    kept = (f"the latest checkpoint, step {last_checkpoint} in {model_dir}, is from before it"
            if last_checkpoint is not None else "no checkpoint had been written yet")
    raise NonFiniteError(
        f"Step {bad[0]}: the loss or a gradient is NaN / Inf (non-finite steps seen: {bad}). "
        f"Training stopped and saved nothing after it; {kept}. Lower LEARNING_RATE (or add "
        "warm-up), check the batches near that step, or let training go on without such "
        "updates: --gin.NONFINITE_POLICY=\"'skip'\" (trainer.train(nonfinite_policy='skip')).")


class PreemptionWatcher:
  """Turns SIGTERM and a first Ctrl-C into a request to save and stop after the current step.

  Use as a context manager around the train loop; the previous handlers come back on exit.
  Installed only in the main thread (Python delivers signals there); elsewhere it watches
  nothing and `requested` only reports other processes' requests. `signal_name` says which
  signal asked ('SIGTERM' or 'SIGINT'), for the message.
  """
  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self._flag = False
    self.signal_name = "SIGTERM"
    self._previous = {}

  def _handle(self, signum, frame):
    if signum == signal.SIGINT:
      if self._flag:  # the second Ctrl-C: stop now
        raise KeyboardInterrupt
      print("\nCtrl-C: finishing this step, then saving a checkpoint and stopping "
            "(Ctrl-C again to stop at once, losing the steps since the last checkpoint).",
            flush=True)
    self._flag = True
    self.signal_name = signal.Signals(signum).name

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}
    return False

  def requested(self) -> bool:
    """True on every process once any process got SIGTERM / Ctrl-C (a collective when multi-host,
    so all processes must call it at the same step)."""
    if jax.process_count() == 1:
      return self._flag
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.asarray(int(self._flag), np.int32))
    return bool(np.any(flags))


class OutOfMemoryError(MemoryError):
  """A train step ran out of accelerator memory (the message names the batch's shapes)."""


TRAIN_STEP_FIX = (
    "([BATCH_SIZE, feature length]). Lower BATCH_SIZE (pipeline.DatasetConfig.batch_size) "
    "or TASK_FEATURE_LENGTHS (pipeline.DatasetConfig.task_feature_lengths), or (T5 "
    "models) trade time for memory with --gin.REMAT_POLICY=\"'full'\" or "
    "--gin.ACTIVATION_DTYPE=\"'bfloat16'\".")


@contextlib.contextmanager
def explain_out_of_memory(batch: Mapping[str, Any], what: str = "The train step",
                          fix: str = TRAIN_STEP_FIX) -> Iterator[None]:
  """Re-raises XLA's RESOURCE_EXHAUSTED (at compile or run time) inside the block as an
  OutOfMemoryError: '<what> ran out of accelerator memory on a global batch of <shapes>
  <fix>', the fix naming the gin bindings that set those shapes (by default the train
  step's); other errors pass unchanged."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    shapes = ", ".join(f"{name} {list(np.shape(value))}" for name, value in sorted(batch.items()))
    raise OutOfMemoryError(
        f"{what} ran out of accelerator memory on a global batch of {shapes} {fix} XLA said: "
        f"{str(e).strip().splitlines()[0][:300]}") from e
