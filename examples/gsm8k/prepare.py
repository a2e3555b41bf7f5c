"""Write GSM8K from the Hugging Face hub as local JSONL files (needs the hub), one per split:

    python examples/gsm8k/prepare.py data/gsm8k        → data/gsm8k/train.jsonl, data/gsm8k/test.jsonl

then train on them with `llmrl train --config examples/gsm8k/gpu.yaml` (or give the hub id directly:
`--dataset openai/gsm8k --dataset_config main --eval_split test`).
"""

import sys
from pathlib import Path

from datasets import load_dataset


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = load_dataset("openai/gsm8k", "main", split=split)
        rows.to_json(f"{out}/{split}.jsonl", lines=True)
        print(f"{out}/{split}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/gsm8k")
