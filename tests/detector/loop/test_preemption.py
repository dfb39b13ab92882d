"""The single-process signal handling of detector.loop.preemption.

The multi-process path runs in tests/integration/test_fault_tolerance.py.
"""

import os
import signal

import pytest

from detector.loop.preemption import PreemptionWatch


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_asks_for_a_stop_and_the_handlers_are_restored(signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionWatch() as watch:
        assert not watch.stop_requested()
        os.kill(os.getpid(), signum)  # delivered before the next bytecode runs
        assert watch.stop_requested()
        assert watch.received == signal.Signals(signum).name
        assert watch.stop_requested()  # every later point too: an abandoned evaluation still ends in a stop
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_interrupt_aborts_without_a_checkpoint():
    with PreemptionWatch() as watch:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # a SIGTERM and one Ctrl-C: still one request to stop
        assert watch.stop_requested()
        with pytest.raises(KeyboardInterrupt, match="second interrupt"):
            os.kill(os.getpid(), signal.SIGINT)
