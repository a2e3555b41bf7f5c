"""Load llmrl checkpoints with plain vLLM and compare its greedy completions with llmrl's own eval.

    python benchmarks/vllm_lora_parity.py RUN_DIR [RUN_DIR ...]

For each run: the newest checkpoint goes to `LLM(model=<base>, enable_lora=True)` as a `LoRARequest`,
the run's eval prompts go through `LLM.chat` (vLLM applies the chat template itself) with
temperature 0, and the completions are compared with the run's last eval in eval_samples.jsonl
(written by llmrl's eval with the run's engine, hf or vllm). Prints one JSON line per run with
`matches` and `prompts`; exits 1 when any completion differs. Needs vLLM (`make vllm`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(run_dirs: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from llmrl.checkpoint import latest_checkpoint
    from llmrl.config import load_config
    from llmrl.models.loading import resolve_model_path
    from llmrl.tasks import task_from_config
    from llmrl.training.run import eval_count, eval_max_new_tokens

    runs = [Path(d) for d in run_dirs]
    cfgs = [load_config(r / "config.yaml") for r in runs]
    if len({c.model for c in cfgs}) != 1:
        raise SystemExit("all runs must share one base model")
    from transformers import AutoConfig

    from llmrl.rollout.vllm_engine import LORA_RANKS

    base = resolve_model_path(cfgs[0].model)
    positions = AutoConfig.from_pretrained(base).max_position_embeddings
    llm = LLM(model=base, dtype="float32", enable_lora=True, enforce_eager=True, seed=0,
              max_lora_rank=next(r for r in LORA_RANKS if r >= max(c.lora_r for c in cfgs)),
              max_model_len=min(1024, positions), kv_cache_memory_bytes=256 << 20)
    failed = False
    for i, (run, cfg) in enumerate(zip(runs, cfgs), start=1):
        task = task_from_config(cfg)
        examples = task.eval_examples(eval_count(cfg, task))
        rows = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
        last = max(r["step"] for r in rows)
        expected = [r["completion"] for r in rows if r["step"] == last]
        params = SamplingParams(temperature=0.0, max_tokens=eval_max_new_tokens(cfg, task))
        outs = llm.chat([ex.messages for ex in examples], params, use_tqdm=False,
                        lora_request=LoRARequest(f"run{i}", i, str(latest_checkpoint(run))))
        got = [o.outputs[0].text for o in outs]
        matches = sum(a == b for a, b in zip(got, expected))
        print(json.dumps({"run": str(run), "engine": cfg.rollout_engine, "step": last, "matches": matches,
                          "prompts": len(expected), "first_difference": next(
                              ([a, b] for a, b in zip(got, expected) if a != b), None)}))
        failed = failed or matches != len(expected) or len(got) != len(expected)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
