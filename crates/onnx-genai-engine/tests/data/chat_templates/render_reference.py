"""Records what Hugging Face's chat-template renderer makes of cases.json
with every template in this folder, into expected.json.

The environment is the one transformers builds for `apply_chat_template`
(jinja2's immutable sandbox, trim_blocks and lstrip_blocks, loop controls,
a `tojson` that is `json.dumps` with ensure_ascii off, `raise_exception`
and `strftime_now`). Run it with jinja2 3.1 when a template or case
changes: `python3 render_reference.py` in this folder.
"""

import json
import pathlib
from datetime import datetime

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = pathlib.Path(__file__).parent


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    cases = json.loads((HERE / "cases.json").read_text())
    env = environment()
    expected = {}
    for path in sorted(HERE.glob("*.jinja")):
        source = path.read_text()
        template = env.from_string(source)
        for case in cases["cases"]:
            context = dict(case.get("vars", {}))
            context.update(
                messages=case["messages"],
                tools=cases["tools"] if case.get("with_tools") else None,
                add_generation_prompt=case.get("add_generation_prompt", True),
                bos_token="<|begin_of_text|>" if "llama" in path.name else "<|im_start|>",
                eos_token="<|eot_id|>" if "llama" in path.name else "<|im_end|>",
            )
            key = f"{path.stem}/{case['name']}"
            if case.get("with_tools") and "tools" not in source:
                # The engine describes the tools in the messages for a
                # template that does not read them (tools.rs); Hugging
                # Face's renderer drops them, so there is nothing to compare.
                expected[key] = {"engine_writes_tools": True}
                continue
            try:
                expected[key] = {"text": template.render(**context)}
            except TemplateError as e:
                expected[key] = {"error": str(e)}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(expected)} renders written to expected.json")


if __name__ == "__main__":
    main()
