"""Diagnostic (not a test): where PD and the monolithic run part on the bf16 hybrid model,
over many prompt lengths, per attention backend. Run on a GPU with the bundle:

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site:$PWD \\
        python3 tests/gpu/divergence_sweep.py OUT.json

For each prompt length L (token ids, a prefix of the demo corpus) it records PD's and the
monolithic answer's first difference, its gap in the monolithic run, and the logprob drift
per position before it. Rounding drift stays at a few bf16 ulps (0.02-0.08 nats); a jump
far above that at one step, with no near tie, points at a structural cause (a wrong or
late-written block), and where the jumps fall (absolute position, offset from the prompt
end, block boundaries) says which.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "e2e"), str(HERE.parent)]

import test_pd_gpu as suite  # noqa: E402
from testkit import evidence  # noqa: E402

LENGTHS = (*range(88, 113, 2), 33, 64, 65, 96, 97, 98, 99, 100, 128, 129, 160, 200, 330)
JUMP_NATS = 0.25
MAX_TOKENS = 24


def _ids(tokenizer_json: Path, n: int, text: str | None = None) -> list[int]:
    from tokenizers import Tokenizer

    from vllm_flagcx.demo import model as demo_model

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(text or demo_model.CORPUS * 8).ids
    return ids[:n]


def _row(d, ids: list[int]) -> dict:
    import engines

    pd = engines.complete(d.router.url, ids, max_tokens=MAX_TOKENS, logprobs=evidence.TOP_K)
    mono = engines.complete(d.prefill.url, ids, max_tokens=MAX_TOKENS, logprobs=evidence.TOP_K)
    if pd.status_code != 200 or mono.status_code != 200:
        return {"L": len(ids), "error": f"{pd.status_code} {pd.text[:200]} / "
                                        f"{mono.status_code} {mono.text[:200]}"}
    a, b = pd.json()["choices"][0], mono.json()["choices"][0]
    diff, drift = evidence.until_parting(a, b, evidence.drift)
    jump = next((i for i, x in enumerate(drift) if x > JUMP_NATS), None)
    return {"L": len(ids), "equal": a["text"] == b["text"],
            "first_index": diff["index"] if diff else None,
            "gap": diff["gap"] if diff else None,
            "jump_index": jump, "jump_position": None if jump is None else len(ids) - 1 + jump,
            "drift": [round(x, 4) for x in drift]}


def main(out: Path) -> int:
    import engines

    from vllm_flagcx.demo import servers as sv

    cases = {c: suite.CASES[c] for c in ("hybrid-bf16-triton_attn", "hybrid-bf16-flash_attn")}
    work = Path(tempfile.mkdtemp(prefix="sweep-"))
    deployments = {c: engines.Deployment(work / c, kind, dtype,
                                         engine_args=(*suite.COMMON, *args), cpu_isa="auto")
                   for c, (kind, dtype, args) in cases.items()}
    engines_all = [s for d in deployments.values() for s in (d.prefill, d.decode)]
    report: dict = {}
    with sv.running(engines_all):
        sv.wait_healthy(engines_all, engines.START_TIMEOUT)
        routers = [d.router for d in deployments.values()]
        with sv.running(routers):
            sv.wait_healthy(routers, 60)
            for case, d in deployments.items():
                tok = d.model / "tokenizer.json"
                rows = [_row(d, _ids(tok, n)) for n in LENGTHS]
                # the suite's third prompt (99 tokens), its prefixes, and itself again
                third = engines.PROMPTS[2]
                rows += [dict(_row(d, _ids(tok, n, third)), prompt=3)
                         for n in (*range(60, 100, 3), 99, 99)]
                report[case] = rows
                out.write_text(json.dumps(report, indent=1))
                for r in rows:
                    print(case, json.dumps({k: v for k, v in r.items() if k != "drift"}),
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
