"""The vllm-server engine on the embedded model, by hand: server start time, greedy parity with the HF policy
at two policy versions, keyed samples repeating, trainer-vs-server log-probs, and no server left after close.

    python benchmarks/vllm_server_smoke.py          (needs `make vllm`)
"""

import dataclasses
import subprocess
import time

import torch

from llmrl.config import load_config, resolve
from llmrl.rollout import add_logprobs, make_engine
from llmrl.rollout.episodes import one_turn
from llmrl.training.run import build_policy

MESSAGES = [[{"role": "user", "content": "Copy this integer exactly: 4821"}], [{"role": "user", "content": "Say hi."}]]


def main() -> None:
    t0 = time.time()
    cfg = load_config(None, {"model": "smollm2-135m-instruct", "task": "format_copy", "device": "cpu",
                             "rollout_engine": "vllm-server", "max_new_tokens": 12, "batch_size": 2, "group_size": 2,
                             "minibatch_size": 2, "lora_dropout": 0.0, "output_dir": "/tmp/llmrl-server-smoke"})
    model, tok, _ = build_policy(cfg, resolve(cfg))
    server = make_engine(cfg, resolve(cfg), tok)
    print(f"server up in {time.time() - t0:.1f} s at {server.server.url}", flush=True)
    hf_cfg = dataclasses.replace(cfg, rollout_engine="hf")
    hf = make_engine(hf_cfg, resolve(hf_cfg), tok)
    for version in (0, 1):
        if version:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05, generator=torch.Generator().manual_seed(version))
        server.load(model, version)
        hf.load(model, version)
        served, trained = (one_turn(e, tok, MESSAGES, group_size=1, seed=0, sampling=dataclasses.replace(e.sampling, max_new_tokens=12), greedy=True).texts
                           for e in (server, hf))
        print(f"v{version} greedy: server {served} / hf {trained}: {'equal' if served == trained else 'DIFFER'}")
    a, b = (one_turn(server, tok, MESSAGES, group_size=2, seed=3, sampling=server.sampling, device="cpu") for _ in range(2))
    print("same keys, same completions:", a.texts == b.texts)
    a = add_logprobs(model, a, chunk=4, group_size=2, shared_prefix=False, with_ref=False)
    print(f"max |trainer - server| log-prob: {float(((a.logp_old - a.engine_logp).abs() * a.completion_mask).max()):.2e}")
    pid = server.server.process.pid
    server.close()
    print(f"server {pid} exited: {server.server.process.poll() is not None}")
    left = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True, text=True).stdout
    print("vLLM server processes left:", left.split() or "none")


if __name__ == "__main__":
    main()
