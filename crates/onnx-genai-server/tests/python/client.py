"""Drives an onnx-genai server with the official OpenAI Python client.

Usage: client.py BASE_URL MODEL. Prints one line per check; exits non-zero on
the first failure.
"""
import json
import sys
import urllib.request

import openai

base, model, vlm = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

ids = [m.id for m in client.models.list().data]
assert sorted(ids) == sorted([model, vlm]), ids
print("models ok")

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
)
assert chat.object == "chat.completion", chat
assert chat.choices[0].message.role == "assistant"
assert chat.usage.completion_tokens == 6, chat.usage
# The answer sent back with the history as the client dumps it: its
# `refusal`, `audio`, `function_call` and `annotations` as null.
dumped = chat.choices[0].message.model_dump()
assert "refusal" in dumped and dumped["refusal"] is None, dumped
again = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Hello"}, dumped, {"role": "user", "content": "More"}],
    max_tokens=2,
    temperature=0,
)
assert again.choices[0].message.role == "assistant", again
print("chat ok")

parts = []
for chunk in client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0, stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
assert "".join(parts) == chat.choices[0].message.content, (parts, chat.choices[0].message.content)
print("stream ok")

request = urllib.request.Request(
    base + "/v1/sessions", data=json.dumps({"model": model}).encode(), headers={"content-type": "application/json"}
)
session = json.load(urllib.request.urlopen(request))["id"]
first = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
    extra_headers={"X-Session-Id": session},
)
second = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "And?"}], max_tokens=3, temperature=0,
    extra_headers={"X-Session-Id": session},
)
assert second.usage.prompt_tokens > first.usage.total_tokens, (first.usage, second.usage)
print("session ok")

# Logit adjustments through the client's own parameters (and vLLM's
# extensions through extra_body): a +100 bias repeats its token, -100 on
# every token greedy chose changes the answer, penalties are served.
biased = client.completions.create(
    model=model, prompt="Once upon", max_tokens=4, temperature=0, logit_bias={"300": 100}
)
repeated = biased.choices[0].text
assert len(repeated) > 4 and repeated == repeated[: len(repeated) // 4] * 4, repeated
def text(**kw):
    return client.completions.create(model=model, prompt="Once upon", max_tokens=12, **kw).choices[0].text


greedy = text(temperature=0)
# Greedy repeats no token here: penalties that reward repeats change it.
assert text(temperature=0, presence_penalty=-2) != greedy
assert text(temperature=0, frequency_penalty=-2) != greedy
assert text(temperature=0, extra_body={"repetition_penalty": 0.3}) != greedy
# At a high temperature, top_k 1 or min_p 1 leave only the likeliest token.
assert text(temperature=1.5, seed=3) != greedy
assert text(temperature=1.5, seed=3, extra_body={"top_k": 1}) == greedy
assert text(temperature=1.5, seed=3, extra_body={"min_p": 1.0}) == greedy
try:
    client.completions.create(model=model, prompt="x", max_tokens=2, logit_bias={"999999": 1})
    raise SystemExit("a logit_bias id outside the vocabulary was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "logit_bias" in str(e), e
# n choices: choice k is the single request with seed + k.
many = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=1.0, seed=11, n=3
)
assert [c.index for c in many.choices] == [0, 1, 2], many
for k, choice in enumerate(many.choices):
    one = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=1.0, seed=11 + k
    )
    assert one.choices[0].message.content == choice.message.content, (k, one, choice)
parts = {}
for chunk in client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=1.0, seed=11, n=3, stream=True
):
    for c in chunk.choices:
        parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
assert parts == {k: c.message.content for k, c in enumerate(many.choices)}, (parts, many)
print("sampling ok")

# Stop strings: the text ends before the stop string, finish_reason is
# "stop" and usage is there, plain and streamed.
plain = client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0).choices[0].text
stop = plain[3:5]
want = plain[: plain.find(stop)]
cut = client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0, stop=[stop])
assert (cut.choices[0].text, cut.choices[0].finish_reason) == (want, "stop"), (cut, stop)
assert cut.usage is not None and cut.usage.completion_tokens > 0, cut
text, finish, usage = "", None, None
for chunk in client.completions.create(
    model=model, prompt="Once upon", max_tokens=12, temperature=0, stop=[stop], stream=True,
    stream_options={"include_usage": True},
):
    for c in chunk.choices:
        text += c.text
        finish = c.finish_reason or finish
    usage = chunk.usage or usage
assert (text, finish) == (want, "stop") and usage is not None, (text, finish, usage, stop)
print("stop ok")

# Structured outputs: every answer under a json_schema format, sampled over
# many seeds and streamed, validates against the schema as the jsonschema
# package (not the server's grammar) reads it. The tiny model's weights are
# random: only the server's token mask can make it write such JSON.
import jsonschema

person = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                "city": {"enum": ["Oslo", "Lima"]},
                "verified": {"type": "boolean"},
            },
            "required": ["zip", "city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
ask = [{"role": "user", "content": "Describe a person."}]
answers = set()
for seed in range(10):
    r = client.chat.completions.create(
        model=model, messages=ask, max_tokens=300, temperature=1.0, seed=seed, response_format=fmt
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", (seed, choice)
    jsonschema.validate(json.loads(choice.message.content), person)
    answers.add(choice.message.content)
assert len(answers) > 1, answers
parts = []
for chunk in client.chat.completions.create(
    model=model, messages=ask, max_tokens=300, temperature=1.0, seed=99, response_format=fmt, stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
jsonschema.validate(json.loads("".join(parts)), person)
try:
    bad = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]}
    client.chat.completions.create(
        model=model,
        messages=ask,
        max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}},
    )
    raise SystemExit("a schema no value satisfies was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.param == "response_format" and "nsatisfiable" in str(e), e
print("structured ok")

# Log-probabilities through the client's own types: one entry per generated
# token with its bytes, the greedy token the likeliest of its
# alternatives; a stream carries the same entries; completions' shape too.
hello = [{"role": "user", "content": "Hello"}]
r = client.chat.completions.create(
    model=model, messages=hello, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
)
scored = r.choices[0].logprobs.content
assert len(scored) == r.usage.completion_tokens == 5, r
for e in scored:
    assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token, e
# (The Rust test checks that the bytes spell the answer; here a token may be
# part of a character, which Python and Rust replace differently.)
assert all(e.bytes and all(0 <= b < 256 for b in e.bytes) for e in scored), scored
streamed = []
for chunk in client.chat.completions.create(
    model=model, messages=hello, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
):
    if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        streamed.extend(chunk.choices[0].logprobs.content)
assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in scored], streamed
c = client.completions.create(model=model, prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
assert len(c.choices[0].logprobs.tokens) == len(c.choices[0].logprobs.token_logprobs) == 4, c
assert all(0 < len(alt) <= 2 for alt in c.choices[0].logprobs.top_logprobs), c
print("logprobs ok")

# Tools: a required call and a named one, plain and streamed (deltas
# reassembled by index), arguments valid against the function's schema;
# the call and its result go back in the next turn.
city = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
tools = [
    {"type": "function", "function": {"name": "weather", "parameters": city}},
    {"type": "function", "function": {"name": "time"}},
]
ask = [{"role": "user", "content": "Weather in Paris?"}]
for choice in ["required", {"type": "function", "function": {"name": "weather"}}]:
    r = client.chat.completions.create(
        model=model, messages=ask, max_tokens=120, temperature=1.0, seed=3, tools=tools, tool_choice=choice
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None, r
    (made,) = message.tool_calls
    assert made.type == "function" and made.id.startswith("call_"), made
    if made.function.name == "weather":
        jsonschema.validate(json.loads(made.function.arguments), city)
    else:
        assert made.function.name == "time" and choice == "required", made
        assert json.loads(made.function.arguments) == {}, made
    calls = {}
    for chunk in client.chat.completions.create(
        model=model, messages=ask, max_tokens=120, temperature=1.0, seed=3, tools=tools, tool_choice=choice, stream=True
    ):
        if not chunk.choices:
            continue
        assert not chunk.choices[0].delta.content, chunk
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or None
    assert finish == "tool_calls" and list(calls) == [0], calls
    assert (calls[0]["name"], calls[0]["arguments"]) == (made.function.name, made.function.arguments), (calls, made)
follow = ask + [message.model_dump(), {"role": "tool", "tool_call_id": made.id, "content": "sunny"}]
r = client.chat.completions.create(model=model, messages=follow, max_tokens=4, tools=tools)
assert r.choices[0].finish_reason in ("length", "stop", "tool_calls"), r
try:
    client.chat.completions.create(
        model=model, messages=ask, max_tokens=4, tools=tools, tool_choice={"type": "function", "function": {"name": "news"}}
    )
    raise SystemExit("an unknown tool_choice was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.param == "tool_choice", e
print("tools ok")

# Images: an inline PNG (written here with zlib) as an image_url part to
# the vision-language model; different images, different first-token
# log-probabilities; a remote URL is refused naming the part.
def png(seed):
    import base64, struct, zlib

    width, height = 8, 8
    rows = b"".join(b"\x00" + bytes(((x * 32) ^ seed) & 255 for x in range(width * 3)) for _ in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def first_logprob(url):
    r = client.chat.completions.create(
        model=vlm,
        max_tokens=2,
        temperature=0,
        logprobs=True,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is it?"},
        ]}],
    )
    return r.choices[0].logprobs.content[0].logprob


assert first_logprob(png(1)) != first_logprob(png(150))
assert first_logprob(png(1)) == first_logprob(png(1))
try:
    first_logprob("https://example.com/cat.png")
    raise SystemExit("a remote image URL was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.param == "messages[0].content[0].image_url", e
print("images ok")

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404 and "no-such-model" in str(e), e
print("error ok")
