"""Before a GPU session's e2e plan: does the plan's load format give a model that works and is not deaf?

One tiny engine (shared-top-k, eager, DBO off, one GPU), 8 prompts x 8 greedy tokens. Exit 0 when
every logprob is finite and the prompts do not all continue alike (the failure mode of vLLM's
``dummy`` weights: nearly every request starts with the same token, the top logprob is near
uniform); exit 1 otherwise, and ``session-e2e.sh`` then falls back to ``--load-format dummy``.
Exit 2 for bad arguments, 3 for a machine that cannot run the engine (no CUDA, no vLLM): neither is a
verdict on the format, and the session stops rather than silently changing the weights.

    python3 tools/gpu/check_load_format.py WORKDIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        helped = bool(argv) and argv[0] in ("-h", "--help")
        print("usage: check_load_format.py WORKDIR   (a directory for the run's logs; see the module docstring)", file=sys.stdout if helped else sys.stderr)
        return 0 if helped else 2
    workdir, existed = Path(argv[0]), Path(argv[0]).exists()
    try:  # a bad WORKDIR is said before the GPU is looked for
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"check_load_format: WORKDIR {argv[0]!r} is not allowed; allowed values: a folder it can create ({exc.strerror})", file=sys.stderr)
        return 2
    from tests.harness.machine import refuse_without_engine

    refused = refuse_without_engine("check_load_format", 1, "nothing checked")
    if refused is not None:
        if not existed:
            workdir.rmdir()
        return refused
    from dbo_runtime.harness.launch import RunSpec, launch
    from dbo_runtime.harness.prompts import PromptSpec
    from tests.e2e import plan
    from tests.load_format import put_on_pythonpath

    put_on_pythonpath()

    spec = RunSpec(
        label="load-format-check",
        engine_args=plan.tiny_args("shared-topk", eager=True),
        prompts=PromptSpec(num=8, min_len=300, max_len=900, seed=5),
        max_tokens=8,
        timeout_s=200,
    )
    record = launch(spec, Path(argv[0]), lambda m: print(m, file=sys.stderr, flush=True))
    if not record.get("ok"):
        print(f"load format {plan.LOAD_FORMAT}: engine failed: {record.get('error')}")
        return 1
    requests = record.get("requests") or []
    firsts = [r["tokens"][0] for r in requests if r.get("tokens")]
    tops = [max(pos.values()) for r in requests for pos in r.get("logprobs") or [] if pos]
    finite = all(math.isfinite(v) for r in requests for pos in r.get("logprobs") or [] for v in pos.values())
    mean_top = sum(tops) / len(tops) if tops else float("nan")
    facts = {"load_format": plan.LOAD_FORMAT, "requests": len(requests), "distinct_first_tokens": len(set(firsts)),
             "mean_top_logprob": mean_top, "finite": finite, "start_s": record.get("start_s")}  # fmt: skip
    print(json.dumps(facts))
    good = finite and len(requests) == 8 and len(set(firsts)) >= 3
    print(f"load format {plan.LOAD_FORMAT}: {'ok' if good else 'NOT usable'}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
