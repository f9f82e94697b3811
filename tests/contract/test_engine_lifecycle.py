"""The CPU engine's lifecycle: stopping it while generations run cancels and joins them first.

Freeing llama.cpp contexts under a thread still inside decode crashed the test suite with a
segmentation fault. The scenario runs in a child process so that a regression fails this test
instead of killing pytest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCENARIO = textwrap.dedent("""
    import asyncio, threading
    from tally_runtime.engine.base import GenerationRequest, SamplingParams
    from tally_runtime.engine.llamacpp import LlamaCppEngine, embedded_model_path

    async def main():
        engine = LlamaCppEngine(embedded_model_path(), context_length=512, slots=2, threads=1)
        await engine.start()
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        streams = [engine.generate(GenerationRequest(f"r{i}.", engine.tokenize("Once upon a time"), params))
                   for i in range(2)]
        for stream in streams:
            await anext(stream)  # both generations are inside llama.cpp now
        assert engine.running_generations == 2, engine.running_generations
        await engine.stop()  # while both are still decoding
        alive = [t.name for t in threading.enumerate() if t.name.startswith("gen-")]
        assert not alive, f"generation threads still running after stop(): {alive}"
        assert engine.running_generations == 0
        for stream in streams:
            await stream.aclose()
        print("stopped cleanly")

    asyncio.run(main())
""")


def test_stop_joins_running_generations_before_freeing_contexts() -> None:
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "stopped cleanly" in done.stdout
