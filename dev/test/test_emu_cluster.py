"""What a real cluster does that the emulator's ideal one hid (issue 35), under the CPU
emulator (dev/emu; NOT a GPU, NOT NCCL), each with the emulator capability that shows it:

- nonblocking NCCL: with --collective-timeout the communicators are nonblocking, and
  ncclCommSplit then answers ncclInProgress with the new communicator NULL until the
  parent is polled to completion (the emulated NCCL does as NCCL 2.18-2.30 do). The
  context-parallel ring must start and train the same bits as without the timeout.
"""
import pytest

from test_emu_multigpu import bins, data, explain, steps, train  # noqa: F401


def test_context_parallel_with_collective_timeout_starts(bins, data):
    """The ring communicator is split from a nonblocking parent: polled on the parent, it trains; the step lines equal
    those of the blocking communicators (a timeout changes how the host waits, not what is computed)."""
    flags = ["-b", "2", "-x", "2", "--context-parallel", "2"]
    blocking = train(bins, data, 2, "fp32", *flags)
    timed = train(bins, data, 2, "fp32", *flags, "--collective-timeout", "60")
    assert timed.returncode == 0, explain(timed)
    assert "context parallel: NCCL ring of 2 in each group" in timed.stdout, explain(timed)
    assert steps(timed) == steps(blocking) and len(steps(blocking)) == 2
