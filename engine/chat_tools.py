"""A chat with tools, rendered for one tokenizer's chat template.

A template that knows tools (it reads `tools`: Qwen2.5, Qwen3, Llama 3.1+, Hermes) gets
them as transformers passes them, `apply_chat_template(messages, tools=...)`, and the
history's calls with their arguments as objects (as transformers' templates expect).

A template that knows none (SmolLM2's, most small chat models) gets the fallback, in the
Hermes format the `hermes` parser reads (the one Qwen2.5 uses):
  - the tool list: a system message (appended to the first one, if any) holding the tools'
    JSON inside `<tools></tools>` and the instruction to answer with
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  - an assistant message's calls: its content followed by one `<tool_call>` block per call;
  - `tool` messages: a `user` message saying in plain words what each tool returned and
    asking for an answer from it (consecutive results share the message). No markup: a
    small model echoes tags it was shown (`<tool_response>` came back in its answers), and
    the reader strips any that still come back (clients/tool_parsers.py).
"""

import json

FALLBACK_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


# after a fallback's tool results: one result, several
ANSWER_FROM = (
    "\n\nAnswer the user's question using this result, in plain words.",
    "\n\nAnswer the user's question using these results, in plain words.",
)


def template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


def knows_tools(tokenizer) -> bool:
    return "tools" in template_of(tokenizer)


def default_tool_parser(tokenizer) -> str:
    """The parser that reads what this model writes: llama3_json for Llama 3.x's template,
    else hermes (Qwen's and Hermes' templates, and the fallback prompt)."""
    template = template_of(tokenizer)
    return "llama3_json" if "<|python_tag|>" in template or "ipython" in template else "hermes"


def chat_text(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text of `messages` (+ `tools`), the generation prompt at its end."""
    if knows_tools(tokenizer):
        return tokenizer.apply_chat_template(
            [_for_template(m) for m in messages], tools=tools or None, tokenize=False, add_generation_prompt=True
        )
    return tokenizer.apply_chat_template(fallback_messages(messages, tools), tokenize=False, add_generation_prompt=True)


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def _for_template(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    functions = [
        {
            "type": "function",
            "id": call["id"],
            "function": {"name": call["function"]["name"], "arguments": _arguments(call)},
        }
        for call in calls
    ]
    return {**message, "content": message.get("content") or "", "tool_calls": functions}


def _arguments(call: dict):
    """A call's arguments as an object where they are JSON (templates write them with tojson)."""
    text = call["function"]["arguments"]
    try:
        return json.loads(text)
    except ValueError:
        return text


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` with the tools, calls and results written into plain role/content messages."""
    names = _call_names(messages)
    out = [_rendered(message, names) for message in messages]
    out = _merge_tool_results(out)
    if tools:
        listing = FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _call_names(messages: list[dict]) -> dict[str, str]:
    """The function name of each call id in the history (what a `tool` message answers)."""
    return {
        call["id"]: call["function"]["name"]
        for message in messages
        for call in message.get("tool_calls") or []
        if call.get("id")
    }


def _rendered(message: dict, names: dict[str, str]) -> dict:
    if message["role"] == "tool":
        name = names.get(message.get("tool_call_id") or "")
        result = message["content"] or ""
        said = f"The tool {name} returned:" if name else "A tool returned:"
        return {"role": "tool", "content": f"{said}\n{result}" if "\n" in result else f"{said} {result}"}
    calls = message.get("tool_calls") or []
    blocks = [
        json.dumps({"name": call["function"]["name"], "arguments": _arguments(call)}, ensure_ascii=False)
        for call in calls
    ]
    content = "\n".join([message.get("content") or "", *(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)])
    return {"role": message["role"], "content": content.strip("\n") if calls else message["content"]}


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """Consecutive results as one user message, ending with the request to answer from them."""
    out: list[dict] = []
    for message in messages:
        if message["role"] != "tool":
            out.append(message)
        elif out and out[-1].get("tool_results"):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + message["content"], "tool_results": 2}
        else:
            out.append({"role": "user", "content": message["content"], "tool_results": 1})
    return [
        {
            "role": m["role"],
            "content": m["content"] + ANSWER_FROM[m["tool_results"] > 1] if m.get("tool_results") else m["content"],
        }
        for m in out
    ]
