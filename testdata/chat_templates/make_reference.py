"""Renders smollm2_hermes_tools.jinja (and SmolLM2's own template) as Hugging Face
transformers' apply_chat_template does (jinja2's sandbox with trim_blocks and
lstrip_blocks, loop controls, transformers' `tojson`) into
smollm2_hermes_tools.reference.json, which engine/tests/it/text.rs compares minijinja's
rendering with. Needs jinja2 (3.1.6 made the file): python3 make_reference.py
"""

import json
import pathlib

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = pathlib.Path(__file__).parent
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers.utils.chat_template_utils: json.dumps, keys in their order.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render(src, **ctx):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    return env.from_string(src).render(**ctx)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now <in> a city & its région",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
# As templates see them: each call's arguments a JSON value, not text.
CHAT = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": "{\"temperature\": 21}", "tool_call_id": "c1"},
    {"role": "tool", "content": "14:05", "tool_call_id": "c2"},
    {"role": "user", "content": "Thanks!"},
]
PLAIN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Capital of France?"},
]

src = (HERE / "smollm2_hermes_tools.jinja").read_text()
cases = [
    {"messages": CHAT, "tools": TOOLS, "rendered": render(src, messages=CHAT, tools=TOOLS, add_generation_prompt=True)},
    {"messages": PLAIN, "tools": None, "rendered": render(src, messages=PLAIN, add_generation_prompt=True)},
    {"messages": PLAIN[1:], "tools": None, "rendered": render(src, messages=PLAIN[1:], add_generation_prompt=True)},
]
# Without tools the template renders as SmolLM2's own.
for c in cases[1:]:
    assert c["rendered"] == render(SMOLLM2, messages=c["messages"], add_generation_prompt=True), c
(HERE / "smollm2_hermes_tools.reference.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
print("wrote smollm2_hermes_tools.reference.json")
