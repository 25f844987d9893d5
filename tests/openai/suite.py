"""The OpenAI API as a real client drives it: the official `openai` Python package
against a running preheat server (`engine serve`, or a gateway with its workers).

Usage: suite.py BASE_URL OUT_JSON. Every check asserts; the answers that must
not depend on the deployment (greedy text, seeded choices) are written to OUT_JSON so
the caller can compare deployments. Exits non-zero on the first failed check.
"""

import json
import sys

import openai

base, out_path = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
# The one model served, under whatever name the deployment gives it.
model = client.models.list().data[0].id
chat = client.chat.completions
comp = client.completions
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
answers = {}


def check(name):
    def run(f):
        f()
        print(f"ok {name}", flush=True)
        return f

    return run


def refused(param, call, kind=openai.BadRequestError):
    try:
        call()
    except kind as e:
        assert e.param == param, (param, e.param, e.message)
        return e
    raise AssertionError(f"{param}: not refused")


@check("models")
def _():
    assert [m.id for m in client.models.list()] == [model]


@check("chat, greedy")
def _():
    r = chat.create(model=model, messages=QUESTION, max_tokens=20, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
    answers["chat"] = text
    answers["chat_usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens]


@check("chat, streamed with usage")
def _():
    chunks = list(
        chat.create(
            model=model,
            messages=QUESTION,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answers["chat"], (text, answers["chat"])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None, last
    assert [last.usage.prompt_tokens, last.usage.completion_tokens] == answers["chat_usage"]
    assert all(c.usage is None for c in chunks[:-1])


@check("completions, logprobs and echo")
def _():
    prompt = "The capital of France is"
    r = comp.create(
        model=model,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 == r.usage.completion_tokens, lp
    assert all(x <= 0 for x in lp.token_logprobs), lp
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs), lp
    assert r.choices[0].finish_reason == "length"
    answers["completion"] = r.choices[0].text
    e = comp.create(model=model, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert e.choices[0].text.startswith(prompt), e.choices[0].text


@check("seed, stop, max_tokens")
def _():
    def seeded():
        return chat.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=7)

    a, b = seeded(), seeded()
    assert a.choices[0].message.content == b.choices[0].message.content
    r = chat.create(model=model, messages=QUESTION, max_tokens=20, temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop", r
    r = chat.create(model=model, messages=QUESTION, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3, r


@check("n choices, whole and streamed")
def _():
    r = chat.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=1.0, seed=3, n=3, logprobs=True
    )
    assert [c.index for c in r.choices] == [0, 1, 2], r
    # The prompt counts once, every choice's tokens count.
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices), r
    answers["n3"] = [c.message.content for c in r.choices]
    finished = {}
    for c in chat.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=1.0, seed=3, n=2, stream=True
    ):
        for ch in c.choices:
            if ch.finish_reason is not None:
                finished[ch.index] = finished.get(ch.index, 0) + 1
    assert finished == {0: 1, 1: 1}, finished
    b = comp.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5, best_of=3)
    assert len(b.choices) == 1 and b.usage.completion_tokens == 18, b
    answers["best_of"] = b.choices[0].text


@check("logit_bias and penalties are honoured")
def _():
    prompt = "apple apple apple apple apple apple"
    plain = comp.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    first = plain.choices[0].logprobs.tokens[0].removeprefix("token_id:")
    banned = comp.create(
        model=model,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logprobs=0,
        logit_bias={first: -100},
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert banned.choices[0].logprobs.tokens[0] != f"token_id:{first}", banned
    penalised = comp.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=1.0,
        extra_body={"ignore_eos": True},
    )
    assert penalised.choices[0].text != plain.choices[0].text, penalised
    # vLLM's extensions ride in extra_body.
    r = comp.create(
        model=model,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 6, "top_k": 5},
    )
    assert r.usage.completion_tokens == 6, r


@check("structured outputs")
def _():
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "enum": ["France", "Spain"]}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    r = chat.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "strict": True, "schema": schema}},
    )
    place = json.loads(r.choices[0].message.content)
    assert set(place) == {"city", "country"} and place["country"] in ("France", "Spain"), place
    answers["json_schema"] = place
    r = chat.create(
        model=model,
        messages=QUESTION,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
    r = chat.create(
        model=model,
        messages=QUESTION,
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["Paris", "Lyon", "Marseille"]},
    )
    # (Greedy among the three first tokens: not necessarily what it would say free.)
    assert r.choices[0].message.content in ("Paris", "Lyon", "Marseille"), r
    answers["choice"] = r.choices[0].message.content
    r = comp.create(
        model=model,
        prompt="The year the Eiffel Tower was finished:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_regex": "[12][0-9]{3}"},
    )
    text = r.choices[0].text
    assert len(text) == 4 and text.isdigit(), text
    answers["regex"] = text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {"type": "object", "properties": {}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_calls(stream):
    """A stream's tool calls as a client assembles them, its content and finish."""
    calls, content, finish = {}, "", None
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        finish = c.choices[0].finish_reason or finish
    return [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], content, finish


@check("tools: a named function, whole and streamed")
def _():
    kw = dict(
        model=model,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
    )
    r = chat.create(**kw)
    m = r.choices[0].message
    assert m.content is None and len(m.tool_calls) == 1, m
    call = m.tool_calls[0]
    assert call.type == "function" and call.id, call
    assert call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str), args
    assert r.choices[0].finish_reason == "stop", r
    answers["tool_named"] = [call.function.name, args]
    calls, content, finish = streamed_calls(chat.create(stream=True, **kw))
    assert calls == [("get_weather", args)] and content == "" and finish == "stop", (calls, content, finish)


@check("tools: required, one call, and the result in the next turn")
def _():
    r = chat.create(
        model=model,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    m = r.choices[0].message
    assert len(m.tool_calls) == 1 and m.tool_calls[0].function.name in ("get_weather", "get_time"), m
    json.loads(m.tool_calls[0].function.arguments)
    assert r.choices[0].finish_reason == "tool_calls", r
    answers["tool_required"] = m.tool_calls[0].function.name
    # The call and its result go back through the template; the model answers in text.
    follow = ASK_WEATHER + [
        m.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "Sunny, 24 degrees Celsius."},
    ]
    r2 = chat.create(model=model, messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=30, temperature=0)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content, r2
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 10, (r.usage, r2.usage)
    answers["tool_followup"] = r2.choices[0].message.content


@check("tools: auto")
def _():
    r = chat.create(model=model, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60, temperature=0)
    m = r.choices[0].message
    # A 135M model may or may not call; either way the answer is well formed.
    if m.tool_calls:
        for c in m.tool_calls:
            json.loads(c.function.arguments)
        assert r.choices[0].finish_reason in ("tool_calls", "length"), r
    else:
        assert m.content, m
    answers["tool_auto"] = m.model_dump(exclude={"tool_calls": {"__all__": {"id"}}})
    print("tool_auto:", json.dumps(answers["tool_auto"]), flush=True)


@check("what is not supported is refused by name")
def _():
    refused("model", lambda: chat.create(model="nope", messages=QUESTION), openai.NotFoundError)
    refused("tool_choice", lambda: chat.create(model=model, messages=QUESTION, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))
    refused(
        "response_format",
        lambda: chat.create(model=model, messages=QUESTION, response_format={"type": "xml"}),
    )
    refused("n", lambda: chat.create(model=model, messages=QUESTION, n=0))
    e = refused(
        "temprature", lambda: chat.create(model=model, messages=QUESTION, extra_body={"temprature": 0.2})
    )
    assert "Unrecognized request argument" in e.message, e.message


with open(out_path, "w") as f:
    json.dump(answers, f, indent=1)
print("all checks passed")
