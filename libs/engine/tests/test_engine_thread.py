"""`EngineThread`: a call's error goes to its caller and the thread goes on, unless it is `EngineFatal` (a dead
parallel peer): then the thread stops and later calls fail at once."""

import pytest

from spindle_engine import Engine, EngineConfig
from spindle_engine.engine_thread import EngineThread
from spindle_engine.errors import EngineFatal
from spindle_model.testing import tiny_llama


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the fatal error ends the thread
def test_a_fatal_call_stops_the_thread_and_an_ordinary_error_does_not():
    _, model = tiny_llama()
    thread = EngineThread(lambda: Engine(EngineConfig(kv_cache_tokens=1024, block_size=4), model=model),
                          lambda *_: None)  # fmt: skip
    thread.start().result(timeout=60)
    try:

        def bad(_: Engine) -> None:
            raise ValueError("a client's mistake")

        with pytest.raises(ValueError):
            thread.call(bad).result(timeout=10)
        assert thread.call(lambda e: e.has_unfinished()).result(timeout=10) is False
        assert thread.is_alive()

        def fatal(_: Engine) -> None:
            raise EngineFatal("a pipeline stage is gone")

        with pytest.raises(EngineFatal):
            thread.call(fatal).result(timeout=10)
        thread._thread.join(10)
        assert not thread.is_alive()
        with pytest.raises(RuntimeError, match="engine thread stopped"):
            thread.call(lambda e: None).result(timeout=10)
    finally:
        thread.stop()
