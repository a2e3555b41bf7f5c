"""The embedded SmolLM2-135M-Instruct: found in its wheel, converted once, chat template rendered."""

import torch

from llmrl.models.loading import find_embedded_gguf, load_base_model
from llmrl.rollout.prompts import encode_prompts
from llmrl.tasks.format_copy import FormatCopyTask


def test_embedded_model_loads_and_renders_chat_template(embedded_path):
    assert find_embedded_gguf("smollm2-135m-instruct").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    model, tok = load_base_model("smollm2-135m-instruct", torch.device("cpu"), torch.float32)
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings
    assert tok.pad_token_id == tok.eos_token_id == 2 and tok.padding_side == "left"
    ex = FormatCopyTask.example(-42)
    text = tok.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a strict formatter.\nReturn the final answer as XML using exactly one tag: "
        "<answer>...</answer>.\nOutput only the XML tag and nothing else.<|im_end|>\n"
        "<|im_start|>user\nCopy this integer exactly: -42<|im_end|>\n<|im_start|>assistant\n"
    )
    ids, mask, truncated = encode_prompts(tok, [ex.messages, FormatCopyTask.example(7).messages], 512, torch.device("cpu"))
    assert truncated == 0 and ids.shape[0] == 2 and mask[:, -1].all()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (2, ids.shape[1], 49152) and torch.isfinite(logits).all()
