"""The CPU engine's decode speed under a CPU limit: every core's worth of threads (the old default) against
the limit's whole CPUs (the default now, tally_runtime/cpu_limit.py), in the same invocation.

Each run is a child process in a cgroup of its own whose CPU quota is the limit (as a pod's `cpu:` limit
sets it), decoding `--tokens` tokens greedily with the embedded SmolLM2 through llama.cpp, as the runtime's
engine does. Both thread counts take turns in every round; the median round is reported. Needs root and a
writable cgroup `cpu` controller (v1 or v2).

    python benchmarks/cpu_limit.py [--limits 0.5,1] [--tokens 128] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from tally_runtime.cpu_limit import threads_for

CHILD = """
import sys, time
from llama_cpp import Llama
from tally_runtime.engine.llamacpp import embedded_model_path
threads, tokens = int(sys.argv[1]), int(sys.argv[2])
llm = Llama(model_path=str(embedded_model_path()), n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
prompt = llm.tokenize(b"Once upon a time, in a quiet village by the sea,")
for i, _ in enumerate(llm.generate(prompt, temp=0.0)):  # warm: the prompt and a few steps
    if i == 4:
        break
llm.reset()
started = time.perf_counter()
for i, _ in enumerate(llm.generate(prompt, temp=0.0)):
    if i + 1 == tokens:
        break
print(tokens / (time.perf_counter() - started))
"""


def make_cgroup(limit: float) -> Path:
    """A cgroup with a CPU quota of `limit` CPUs per 100 ms period (v1 or v2, whichever is mounted)."""
    name = f"tally-bench-{uuid.uuid4().hex[:8]}"
    quota = int(limit * 100_000)
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        group = v1 / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        return group
    group = Path("/sys/fs/cgroup") / name
    group.mkdir()
    (group / "cpu.max").write_text(f"{quota} 100000")
    return group


def decode_rate(group: Path, threads: int, tokens: int) -> float:
    """Tokens per second of one child decoding in `group`."""
    done = subprocess.run(
        ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$1" -c "$2" "$3" "$4"', str(group), sys.executable,
         CHILD, str(threads), str(tokens)], capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the decode child failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="0.5,1")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    results: list[dict[str, Any]] = []
    for limit in (float(x) for x in args.limits.split(",")):
        chosen = threads_for(cores, limit)
        if chosen == cores:
            print(f"limit {limit:g}: the limit's threads equal the cores ({cores}); nothing to compare")
            continue
        try:
            group = make_cgroup(limit)
        except OSError as err:
            raise SystemExit(f"needs root and a writable cgroup cpu controller: {err}") from None
        try:
            rounds: dict[int, list[float]] = {cores: [], chosen: []}
            for r in range(args.repeats):
                for threads in ((cores, chosen) if r % 2 == 0 else (chosen, cores)):
                    rounds[threads].append(decode_rate(group, threads, args.tokens))
        finally:
            group.rmdir()
        old, new = statistics.median(rounds[cores]), statistics.median(rounds[chosen])
        results.append({"limit": limit, "cores": cores, "old_threads": cores, "new_threads": chosen,
                        "old_tok_s": round(old, 1), "new_tok_s": round(new, 1), "ratio": round(new / old, 2)})
        print(f"limit {limit:g} CPU on {cores} cores: {cores} threads {old:.1f} tok/s, {chosen} thread(s) "
              f"{new:.1f} tok/s: {new / old:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
