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

import functools
import hashlib
import json
import os
import select
import subprocess
import sys
import time
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
    """Give the tokenizer the template `value` names (None: keep the model's own); a template file must first render
    sample conversations in time (`check_template_renders`)."""
    if value is not None:
        text = chat_template_text(value)
        if value not in CHAT_TEMPLATES:
            check_template_renders(text, value)
        tokenizer.chat_template = text


RENDER_LIMIT = 10.0  # seconds a template file's sample renders may take, all together (each takes milliseconds)
RENDER_STARTUP_LIMIT = 300.0  # seconds the checking process may take to import transformers (a loaded machine)
RENDER_MEMORY_BYTES = 4 << 30  # the checking process's address space
SAMPLE_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
SAMPLE_RENDERS = [  # (messages, tools, add_generation_prompt): the shapes llmrl renders
    ([{"role": "user", "content": "Hi."}], None, True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
      {"role": "assistant", "content": "\\boxed{5}"}, {"role": "user", "content": "And 3+4?"}], None, True),
    ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], None, False),
    ([{"role": "user", "content": "Add 2 and 3."},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
      {"role": "tool", "content": "5"}], [SAMPLE_TOOL], True),
]
RENDER_CHILD = """
import json, os, sys
from llmrl.grading import exit_with_parent
exit_with_parent()  # a trainer killed while it waits does not leave a template looping here
from transformers.utils.chat_template_utils import render_jinja_template
try:  # the address space the imports took, and the cap on top
    import resource
    now = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (now + MEMORY_BYTES, now + MEMORY_BYTES))
except (ImportError, OSError, ValueError):
    pass
job = json.loads(sys.stdin.readline())
print("ready", flush=True)
for messages, tools, generation in job["renders"]:
    try:
        render_jinja_template([messages], tools=tools, chat_template=job["template"], add_generation_prompt=generation)
    except MemoryError:
        print("memory", flush=True)
        sys.exit(0)
    except Exception:
        pass  # a template may refuse a shape (raise_exception); only time and memory are judged here
print("done", flush=True)
"""


@functools.cache
def _renders_in_time(digest: str, text: str) -> str | None:
    """None when template `text` renders SAMPLE_RENDERS in a child process within RENDER_LIMIT seconds (counted
    from when the child has imported transformers) and its memory cap; else why not. The child is killed past the
    limit. Cached per template (`digest`: its SHA-256)."""
    from llmrl.grading import PARENT_PID

    child = subprocess.Popen([sys.executable, "-c", RENDER_CHILD.replace("MEMORY_BYTES", str(RENDER_MEMORY_BYTES))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env={**os.environ, PARENT_PID: str(os.getpid())},
                             start_new_session=True)  # a Ctrl-C at the terminal is the trainer's
    try:
        try:
            child.stdin.write((json.dumps({"template": text, "renders": SAMPLE_RENDERS}) + "\n").encode())
            child.stdin.close()
        except OSError:
            pass  # it died at once: read below
        lines: list[str] = []
        buffer, fd = b"", child.stdout.fileno()
        deadline = time.monotonic() + RENDER_STARTUP_LIMIT
        while not lines or lines[-1] == "ready":
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                return (f"its sample renders took over {RENDER_LIMIT:g} s" if lines
                        else f"the process checking it did not start in {RENDER_STARTUP_LIMIT:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return f"the process rendering it died (exit {child.wait()})"
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                lines.append(line.decode(errors="replace").strip())
                if lines[-1] == "ready":
                    deadline = time.monotonic() + RENDER_LIMIT  # the renders' clock starts when the imports are done
        return None if lines[-1] == "done" else f"its sample renders need over {RENDER_MEMORY_BYTES >> 30} GiB of memory"
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def check_template_renders(text: str, value: str) -> None:
    """Refuse, in one line naming it, a chat template that does not render a few short sample conversations (a user
    turn, a system prompt and several turns, tool schemas and a tool call) within RENDER_LIMIT seconds: a template
    with nested huge loops (`{% for i in range(100000) %}{% for j in range(100000) %}`) would hang every prompt it
    renders. The renders run in a child process (transformers' own renderer, its Jinja sandbox) that is killed past
    the limit. A template that raises on a sample is left to say so where it is used. Not covered: a template slow
    only on inputs unlike the samples (very long or many messages, particular contents)."""
    why = _renders_in_time(hashlib.sha256(text.encode()).hexdigest(), text)
    if why is not None:
        raise ConfigError(f"chat_template={value!r}: {why}; a template that loops for ever would hang every prompt "
                          "it renders (fix its loops)")
