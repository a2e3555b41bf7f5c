"""Chat templates llmrl ships, and `--chat_template FILE_OR_NAME`.

    chatml-tools   ChatML (<|im_start|>role … <|im_end|>) with tool calling, for the embedded SmolLM2 model,
                   whose own template has no tools. Without tools it renders exactly as SmolLM2's template
                   (the same default system message). With `tools=` the system message lists their JSON
                   schemas and asks for calls as <tool_call>{"name": …, "arguments": {…}}</tool_call>;
                   a `role: "tool"` message is a user turn wrapped in <tool_response>…</tool_response>.

The template replaces the tokenizer's own for everything the run renders (training, eval, chat) and is
saved with an exported model.
"""

from __future__ import annotations

from pathlib import Path

from llmrl.errors import ConfigError

CHATML_TOOLS = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = default_system -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system -}}"
    "{%- if tools -%}"
    "{{- '\\n\\nYou have these tools (JSON schemas):\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nTo call a tool, write one line per call:\\n<tool_call>{\"name\": \"TOOL\", \"arguments\": {\"ARG\": VALUE}}</tool_call>\\n"
    "Each result comes back in <tool_response></tool_response>.' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set f = call['function'] if call.get('function') else call -%}"
    "{{- '\\n<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' + (f['arguments'] | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CHAT_TEMPLATES = {"chatml-tools": CHATML_TOOLS}


def chat_template_text(value: str) -> str:
    """The Jinja text of a built-in template name or a template file (one ConfigError line when unreadable)."""
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"chat_template={value!r}: cannot read it: {e.strerror or e}") from None


def use_chat_template(tokenizer, value: str | None) -> None:
    """Give the tokenizer the template `value` names (None: keep the model's own)."""
    if value is not None:
        tokenizer.chat_template = chat_template_text(value)
